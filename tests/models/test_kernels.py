"""QLoRA and Liger model patches: the configuration path on the CPU (up to the refusal), the real
thing on a GPU (tests marked gpu)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.models import kernels
from rlhf_lightning.models.kernels import (
    LIGER_PATCHES,
    apply_liger,
    quantization_config,
    quantized_load_kwargs,
)
from rlhf_lightning.run.validation import validate
from tests.conftest import FAST, compose_config


def pretend_installed(monkeypatch, *names: str) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        kernels.importlib.util, "find_spec", lambda n, *a: object() if n in names else real(n, *a)
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_qlora_on_cpu_is_refused_with_the_reason(tmp_path, monkeypatch):
    cfg = compose_config(["model.quantization=4bit"], output_dir=tmp_path)
    if importlib.util.find_spec("bitsandbytes") is None:
        with pytest.raises(
            ConfigError, match=r"model.quantization='4bit'.*pip install 'rlhf_lightning\[qlora\]'"
        ):
            validate(cfg)
    pretend_installed(monkeypatch, "bitsandbytes")
    with pytest.raises(ConfigError, match=r"model.quantization='4bit'.*a CUDA GPU.*model.quantization=null"):
        validate(cfg)
    with pytest.raises(ConfigError, match=r"model.quantization='8bit'.*CUDA"):
        validate(compose_config(["model.quantization=8bit"], output_dir=tmp_path))


def test_qlora_needs_lora_and_known_values(tmp_path):
    with pytest.raises(ConfigError, match=r"model.quantization='4bit'.*finetune=lora"):
        validate(compose_config(["model.quantization=4bit", "model.finetune=full"], output_dir=tmp_path))
    with pytest.raises(ConfigError, match=r"model.quantization='3bit'.*null, 4bit or 8bit"):
        validate(compose_config(["model.quantization=3bit"], output_dir=tmp_path))
    with pytest.raises(ConfigError, match=r"model\.quant_type"):
        validate(compose_config(["model.quant_type=int4"], output_dir=tmp_path))


def test_bitsandbytes_config_keeps_the_lm_head_unquantised(monkeypatch):
    cfg = quantization_config("4bit", "fp4", double_quant=False, compute_dtype=torch.float16)
    assert cfg.load_in_4bit and not cfg.load_in_8bit
    assert (cfg.bnb_4bit_quant_type, cfg.bnb_4bit_use_double_quant) == ("fp4", False)
    assert cfg.bnb_4bit_compute_dtype == torch.float16
    assert cfg.llm_int8_skip_modules == ["lm_head"]
    eight = quantization_config("8bit")
    assert eight.load_in_8bit and eight.llm_int8_skip_modules == ["lm_head"]
    monkeypatch.setenv("LOCAL_RANK", "3")
    kwargs = quantized_load_kwargs("4bit", "nf4", True, torch.bfloat16)
    assert kwargs["device_map"] == {"": 3} and kwargs["dtype"] == torch.bfloat16
    assert kwargs["quantization_config"].bnb_4bit_use_double_quant


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_liger_kernels_on_cpu_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"model.liger_kernels=True.*CUDA GPU.*liger_kernels=false"):
        validate(compose_config(["model.liger_kernels=true"], output_dir=tmp_path))


def test_liger_patches_keep_the_models_outputs_and_refuse_unknown_models(tiny_model, monkeypatch):
    # liger_kernel.transformers imports triton at import time (its kernels are Triton programs);
    # `make install-dev` installs both, so `make test` and CI run this everywhere.
    pytest.importorskip(
        "liger_kernel", reason="needs liger-kernel: make install-dev (or pip install liger-kernel)"
    )
    pytest.importorskip(
        "triton", reason="liger_kernel.transformers imports triton: make install-dev (or pip install triton)"
    )
    import liger_kernel.transformers as lt
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    seen = {}

    def fake_qwen2(rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=True,
                   model=None):  # fmt: skip
        seen.update(rope=rope, cross_entropy=cross_entropy, fused_linear_cross_entropy=fused_linear_cross_entropy,
                    rms_norm=rms_norm, swiglu=swiglu)  # fmt: skip

    monkeypatch.setitem(MODEL_TYPE_TO_APPLY_LIGER_FN, "qwen2", fake_qwen2)
    apply_liger(tiny_model)
    # No loss patches: log-probs come from hidden states through the chunked lm-head op.
    assert seen == {"rope": True, "rms_norm": True, "swiglu": True, "cross_entropy": False,
                    "fused_linear_cross_entropy": False}  # fmt: skip
    assert LIGER_PATCHES["fused_linear_cross_entropy"] is False
    tiny_model.config.model_type = "not_a_model"
    with pytest.raises(ConfigError, match="model type Liger patches"):
        apply_liger(tiny_model)
    assert lt is not None


# ------------------------------------------------------------------ on a GPU


def qwen05b_sized(directory, tokenizer_dir) -> str:
    """Random weights of Qwen2.5-0.5B's shape (494M parameters) with the tiny tokenizer."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = Qwen2Config(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
    tok.save_pretrained(directory)
    return str(directory)


def peak_memory_of_3_steps(path: str, tmp_path, *overrides: str) -> tuple[float, float]:
    from rlhf_lightning.run import run

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    cfg = compose_config(
        [*FAST, "model=local", f"model.path={path}", "model.dtype=bfloat16", "trainer.max_steps=3",
         "trainer.val_check_interval=100", "eval.before_training=false", "eval.at_end=false",
         "checkpoint.every_n_steps=0", "trainer.accelerator=gpu", "trainer.devices=1", *overrides],
        output_dir=tmp_path,
    )  # fmt: skip
    result = run(cfg)
    reward = float(result.trainer.callback_metrics["rollout/reward_mean"])
    return torch.cuda.max_memory_allocated() / 2**30, reward


@pytest.mark.gpu
@pytest.mark.slow
def test_qlora_trains_a_qwen05b_sized_model_in_less_memory_than_bf16_lora(tmp_path, tiny_path):
    pytest.importorskip("bitsandbytes")
    path = qwen05b_sized(tmp_path / "m", tiny_path)
    bf16, _ = peak_memory_of_3_steps(path, tmp_path / "bf16")
    four_bit, reward = peak_memory_of_3_steps(path, tmp_path / "4bit", "model.quantization=4bit")
    print(f"peak GPU memory, 3 GRPO steps: bf16 LoRA {bf16:.2f} GiB, 4-bit QLoRA {four_bit:.2f} GiB")
    assert four_bit < bf16 and reward == reward


@pytest.mark.gpu
@pytest.mark.slow
def test_liger_patched_model_gives_the_same_logprobs(tiny_path):
    pytest.importorskip("triton")
    from rlhf_lightning.models.build import build_policy, load_model

    ids = torch.randint(3, 300, (4, 48), device="cuda")
    mask = torch.ones_like(ids)
    action = torch.zeros(4, 47, dtype=torch.bool, device="cuda")
    action[:, 20:] = True
    out = []
    for liger in (False, True):
        policy = build_policy(load_model(tiny_path, dtype="float32", liger_kernels=liger)).cuda()
        with torch.no_grad():
            out.append(policy.token_logprobs(ids, mask, action)[0])
    assert (out[0] - out[1])[action].abs().max() < 1e-4
