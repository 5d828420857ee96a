"""transformers' own flash-attention path on the CPU, its two kernels replaced by exact attention.

Everything transformers does around the kernels (masks, unpadding, the packed-sequence check on
``position_ids``, the varlen call with cumulative lengths) runs as on a GPU; only
``flash_attn_func`` and ``flash_attn_varlen_func`` are plain float attention here. A model that
mixes up packed sequences under real flash attention mixes them up here too.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from transformers import modeling_flash_attention_utils as fa_utils


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, causal: bool
) -> torch.Tensor:
    """Exact attention of one sequence. q: (S, Hq, D); k, v: (S, Hk, D) -> (S, Hq, D)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=causal, scale=scale
    )
    return out.transpose(0, 1)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, **_: Any):
    """(B, S, H, D) in and out, every row one sequence."""
    return torch.stack([_attend(q[b], k[b], v[b], softmax_scale, causal) for b in range(q.shape[0])])


def flash_attn_varlen_func(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, dropout_p=0.0,
    softmax_scale=None, causal=False, **_: Any,
):  # fmt: skip
    """(T, H, D) in and out: the sequences cut at ``cu_seqlens``, each attended alone."""
    out = torch.empty_like(q)
    bounds = cu_seqlens_q.tolist()
    for start, end in itertools.pairwise(bounds):
        out[start:end] = _attend(q[start:end], k[start:end], v[start:end], softmax_scale, causal)
    return out


@contextmanager
def emulated_flash(model: Any) -> Iterator[None]:
    """Run ``model`` (a transformers CausalLM, or a peft model around one) through transformers'
    ``flash_attention_2`` path with the exact kernels above."""
    kernels = (flash_attn_func, flash_attn_varlen_func, None, fa_utils._pad_input, fa_utils._unpad_input)
    process = (fa_utils._lazy_define_process_function(flash_attn_varlen_func), dict)
    original = fa_utils.lazy_import_flash_attention
    configs = {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}
    before = {key: c._attn_implementation for key, c in configs.items()}
    fa_utils.lazy_import_flash_attention = lambda *a, **k: (kernels, process)
    for c in configs.values():
        c._attn_implementation = "flash_attention_2"
    try:
        yield
    finally:
        fa_utils.lazy_import_flash_attention = original
        for key, c in configs.items():
            c._attn_implementation = before[key]
