"""GPU-only model options: QLoRA (a bitsandbytes-quantised frozen base) and Liger's model patches.

Both are checked at start-up (:func:`gpu_model_problem`), so a CPU machine gets one message
naming the option and the fix instead of a traceback from deep inside a kernel library.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import Any

import torch

from rlhf_lightning.config.errors import ConfigError

log = logging.getLogger(__name__)

QUANTIZATIONS = (None, "4bit", "8bit")
QUANT_TYPES = ("nf4", "fp4")
# Liger's patches that keep the model's outputs as they are. Its fused linear cross-entropy and
# plain cross-entropy replace the loss of ``model(labels=...)``, which nothing here calls: log-probs
# come from hidden states through the chunked lm-head op (ops/logprobs.py), never full logits.
LIGER_PATCHES = {"rope": True, "rms_norm": True, "swiglu": True, "cross_entropy": False,
                 "fused_linear_cross_entropy": False}  # fmt: skip


def gpu_model_problem(
    quantization: str | None, liger_kernels: bool, finetune: str
) -> tuple[str, Any, str] | None:
    """``(field, value, what is needed)`` when a GPU-only option cannot run here, else None."""
    if quantization not in QUANTIZATIONS:
        return "model.quantization", quantization, "null, 4bit or 8bit"
    if quantization is not None:
        if finetune != "lora":
            return (
                "model.quantization",
                quantization,
                "model.finetune=lora: a quantised base is frozen (QLoRA)",
            )
        if importlib.util.find_spec("bitsandbytes") is None:
            return (
                "model.quantization", quantization,
                "the bitsandbytes package: pip install 'rlhf_lightning[qlora]' (on a CUDA machine)",
            )  # fmt: skip
        if not torch.cuda.is_available():
            return (
                "model.quantization", quantization,
                "a CUDA GPU: bitsandbytes' 4-bit and 8-bit kernels do not run on this machine's CPU; "
                "set model.quantization=null here",
            )  # fmt: skip
    if liger_kernels:
        if not torch.cuda.is_available():
            return (
                "model.liger_kernels",
                True,
                "a CUDA GPU (Liger's Triton kernels); set model.liger_kernels=false here",
            )
        if importlib.util.find_spec("liger_kernel") is None or importlib.util.find_spec("triton") is None:
            return "model.liger_kernels", True, "liger-kernel and triton: pip install 'rlhf_lightning[liger]'"
    return None


def quantization_config(
    quantization: str,
    quant_type: str = "nf4",
    double_quant: bool = True,
    compute_dtype: torch.dtype = torch.bfloat16,
) -> Any:
    """A ``BitsAndBytesConfig`` for a frozen base; the lm_head stays unquantised, so the chunked
    log-prob path reads the same (exact) output weights as without quantisation."""
    from transformers import BitsAndBytesConfig

    if quantization == "4bit":
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=quant_type,
            bnb_4bit_use_double_quant=double_quant,
            bnb_4bit_compute_dtype=compute_dtype,
            llm_int8_skip_modules=["lm_head"],
        )
    return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=["lm_head"])


def quantized_load_kwargs(
    quantization: str, quant_type: str, double_quant: bool, compute_dtype: torch.dtype
) -> dict:
    """``from_pretrained`` keywords: the quantisation config, on this process's GPU."""
    return {
        "quantization_config": quantization_config(quantization, quant_type, double_quant, compute_dtype),
        "device_map": {"": int(os.environ.get("LOCAL_RANK", 0))},
        "dtype": compute_dtype,
    }


def apply_liger(model: torch.nn.Module) -> None:
    """Liger's kernels patched into ``model`` (RoPE, RMSNorm, SwiGLU; no loss patches)."""
    from liger_kernel.transformers import _apply_liger_kernel_to_instance
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise ConfigError(
            "model.liger_kernels", True,
            f"a model type Liger patches ({', '.join(sorted(MODEL_TYPE_TO_APPLY_LIGER_FN))}), not {model_type!r}",
        )  # fmt: skip
    _apply_liger_kernel_to_instance(model=model, **LIGER_PATCHES)
    log.info("Liger kernels applied to %s: %s", type(model).__name__, LIGER_PATCHES)
