"""rlhf_lightning.export: the merge's dtype arithmetic and safe checkpoint loading, on small
hand-built run directories (no training)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rlhf_lightning.export import main as export_main
from rlhf_lightning.export import merge_dtype
from rlhf_lightning.models.tiny import TINY_MODEL_DIR

TARGET = "model.layers.0.mlp.up_proj"  # a LoRA-adapted weight
OTHER = "model.layers.0.self_attn.q_proj.weight"  # not adapted
R, ALPHA = 4, 8  # scale alpha / r = 2: exact
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(scope="module")
def bf16_base(tmp_path_factory) -> Path:
    """The tiny model saved in bfloat16 (as most Hub checkpoints are), with its tokenizer."""
    out = tmp_path_factory.mktemp("bf16_base")
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, dtype=torch.float32)
    model.to(torch.bfloat16).save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copy(TINY_MODEL_DIR / name, out / name)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    return out


def base_weights(base: Path) -> dict[str, torch.Tensor]:
    """The base's weights, exactly, in float32 (bf16 -> float32 is exact)."""
    return {k: v.float() for k, v in load_file(base / "model.safetensors").items()}


def write_run(root: Path, base: Path, dtype: str) -> tuple[Path, torch.Tensor]:
    """A LoRA run directory on ``base`` (``model.dtype=dtype``) whose up_proj adapters hold small
    dyadic values, so B A * scale is exact in float32 whatever the summation order. Returns the
    run and layer 0's delta (out, in), computed in float64 from the saved factors."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(r=R, lora_alpha=ALPHA, target_modules=["up_proj"]))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_A" in name:  # entries in {-1, 0, 1} / 16
                p.copy_(torch.randint(-1, 2, p.shape, generator=g).float() / 16)
            elif "lora_B" in name:  # entries in {-3..3} / 4096: deltas near bf16's spacing here
                p.copy_(torch.randint(-3, 4, p.shape, generator=g).float() / 4096)
    actor = root / "checkpoints" / "adapters" / "last" / "actor"
    peft.save_pretrained(actor)
    saved = load_file(actor / "adapter_model.safetensors")
    a, b = (saved[f"base_model.model.{TARGET}.lora_{x}.weight"].double() for x in "AB")
    cfg = {"model": {"name": "t", "path": str(base), "dtype": dtype, "finetune": "lora"}}
    OmegaConf.save(OmegaConf.create(cfg), root / "config.yaml")
    return root, (b @ a * (ALPHA / R)).float()


def merged(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "model.safetensors")


def test_merge_dtype_prefers_the_flag_then_the_run_then_the_checkpoint():
    assert merge_dtype("bfloat16", "float32", "float16") == "bfloat16"
    assert merge_dtype("auto", "float32", "bfloat16") == "float32"
    assert merge_dtype("auto", "auto", "bfloat16") == "bfloat16"
    assert merge_dtype("auto", "auto", None) == "float32"


def test_bf16_base_merges_to_one_rounding_of_the_float32_sum(bf16_base, tmp_path):
    src, delta = write_run(tmp_path / "run", bf16_base, "auto")  # auto: the checkpoint's bf16
    export_main([str(src), "--out", str(tmp_path / "o"), "--merge"])
    w = base_weights(bf16_base)
    got = merged(tmp_path / "o")
    want = (w[f"{TARGET}.weight"] + delta).to(torch.bfloat16)
    assert got[f"{TARGET}.weight"].dtype == torch.bfloat16 and torch.equal(got[f"{TARGET}.weight"], want)
    assert torch.equal(got[OTHER], w[OTHER].to(torch.bfloat16))
    moved = want.float() != w[f"{TARGET}.weight"]
    lost = (delta != 0) & ~moved  # deltas below the spacing: rounded away, as they must be in bf16
    assert moved.any() and lost.any()
    assert json.loads((tmp_path / "o" / "config.json").read_text())["dtype"] == "bfloat16"


def test_float32_run_on_a_bf16_base_exports_float32_with_the_whole_delta(bf16_base, tmp_path):
    """The old export merged in the checkpoint's bf16: deltas below bf16's spacing were lost."""
    src, delta = write_run(tmp_path / "run", bf16_base, "float32")
    export_main([str(src), "--out", str(tmp_path / "o"), "--merge"])  # --dtype auto: the run's
    w = base_weights(bf16_base)[f"{TARGET}.weight"]
    got = merged(tmp_path / "o")[f"{TARGET}.weight"]
    assert got.dtype == torch.float32 and torch.equal(got, w + delta)
    assert not torch.equal(got, (w + delta).to(torch.bfloat16).float())  # what a bf16 merge keeps


def test_bf16_export_of_a_float32_base_rounds_once(tmp_path):
    """The old export loaded the float32 base in bf16, then rounded base + delta again."""
    src, delta = write_run(tmp_path / "run", TINY_MODEL_DIR, "float32")
    export_main([str(src), "--out", str(tmp_path / "o"), "--merge", "--dtype", "bfloat16"])
    w = base_weights(TINY_MODEL_DIR)[f"{TARGET}.weight"]
    got = merged(tmp_path / "o")[f"{TARGET}.weight"]
    once = (w + delta).to(torch.bfloat16)
    twice = (w.to(torch.bfloat16).float() + delta).to(torch.bfloat16)
    assert torch.equal(got, once)
    assert not torch.equal(once, twice)  # the case distinguishes the two


class WritesMarker:
    """Unpickling this opens (creates) ``path``: a stand-in for arbitrary code in a checkpoint."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


def full_run(root: Path, payload: object) -> Path:
    """A full fine-tuning run directory whose last.ckpt is ``payload``."""
    (root / "checkpoints").mkdir(parents=True)
    cfg = {"model": {"name": "t", "path": str(TINY_MODEL_DIR), "dtype": "float32", "finetune": "full"}}
    OmegaConf.save(OmegaConf.create(cfg), root / "config.yaml")
    torch.save(payload, root / "checkpoints" / "last.ckpt")
    return root


def test_a_checkpoint_with_pickled_code_is_refused_unexecuted(tmp_path):
    marker = tmp_path / "marker"
    weights = {"policy.model.model.norm.weight": torch.ones(128)}
    src = full_run(tmp_path / "run", {"state_dict": weights, "callbacks": {"x": WritesMarker(marker)}})
    ckpt = src / "checkpoints" / "last.ckpt"
    with pytest.raises(SystemExit) as refused:
        export_main([str(src), "--out", str(tmp_path / "o"), "--merge"])
    assert not marker.exists()  # nothing in the file ran
    assert re.fullmatch(
        f"error: refusing to load {re.escape(str(ckpt))}: .*pickles io.open.*", str(refused.value)
    )
    assert not (tmp_path / "o").exists()


def test_an_unreadable_checkpoint_is_named(tmp_path):
    src = full_run(tmp_path / "run", {"state_dict": {}})
    (src / "checkpoints" / "last.ckpt").write_bytes(b"not a checkpoint")
    with pytest.raises(
        SystemExit, match="error: cannot read " + re.escape(str(src / "checkpoints" / "last.ckpt"))
    ):
        export_main([str(src), "--out", str(tmp_path / "o"), "--merge"])
    with pytest.raises(SystemExit, match=r"choose --which among \['last'\]"):
        export_main([str(src), "--out", str(tmp_path / "o"), "--merge", "--which", "best"])
