"""Prompt sharing: rows that share a prompt (a GRPO group) run its prefix through the body once,
and its KV cache is copied to every row; plus the KV-cache argument names of transformers."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn


def cache_kwarg(module: nn.Module) -> str:
    """The name of the KV-cache argument of ``module.forward`` (``cache`` in transformers 5)."""
    return "cache" if "cache" in inspect.signature(type(module).forward).parameters else "past_key_values"


def output_cache(out: Any) -> Any:
    """The KV cache of a forward's output (``cache`` in transformers 5, else ``past_key_values``)."""
    return getattr(out, "cache", None) or out.past_key_values


def shared_prefix_hidden(
    body: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    action_mask: torch.Tensor,
    prompt_lens: torch.Tensor,
    prefix_ids: torch.Tensor,
) -> torch.Tensor:
    """Hidden states at the action positions, running each distinct prompt once.

    Rows with the same ``prefix_ids`` share their first ``prompt_lens`` tokens (a GRPO group).
    The prompt minus its last token runs once per distinct prompt (U rows, right-padded); its KV
    cache is copied to every row (differentiably), and each row's suffix (last prompt token +
    everything after it) runs on top. Values and gradients equal a plain forward of each row.

    Args:
        input_ids, attention_mask: right-padded rows. Shape: (B, L)
        action_mask: Shape: (B, L-1); no action before ``prompt_lens - 1``.
        prompt_lens, prefix_ids: Shape: (B,)

    Returns:
        hidden states of the action positions, row-major. Shape: (N, H)
    """
    b, width = input_ids.shape
    device = input_ids.device
    uniq, inverse = torch.unique(prefix_ids, return_inverse=True)  # (U,), (B,)
    rows = torch.arange(b, device=device)
    first = torch.full((len(uniq),), b, device=device).scatter_reduce(0, inverse, rows, "amin")  # (U,)
    plen = prompt_lens[first] - 1  # shared prefix: all but the last prompt token
    w = int(plen.max())
    # Prefixes, right-padded: (U, W). (Right, not left: a left-padded row has query positions
    # that see no key at all, which turns into NaN in float64 attention.)
    pre_mask = (torch.arange(w, device=device)[None, :] < plen[:, None]).long()
    pre_ids = input_ids[first, :w] * pre_mask
    pre_pos = torch.arange(w, device=device).expand(len(uniq), w)
    # Suffixes, right-padded: (B, S), from each row's last prompt token to its end.
    start = prompt_lens - 1
    lens = attention_mask.sum(-1)
    s = int((lens - start).max())
    idx = start[:, None] + torch.arange(s, device=device)[None, :]
    suf_mask = (idx < lens[:, None]).long()
    suf_ids = input_ids.gather(1, idx.clamp(max=width - 1)) * suf_mask
    suf_pos = plen[inverse][:, None] + torch.arange(s, device=device)[None, :]
    key = cache_kwarg(body)
    cache = output_cache(
        body(input_ids=pre_ids, attention_mask=pre_mask, position_ids=pre_pos, use_cache=True)
    )
    cache.batch_select_indices(inverse)  # (U, ...) -> (B, ...), differentiable
    full_mask = torch.cat([pre_mask[inverse], suf_mask], dim=1)
    hidden = body(
        input_ids=suf_ids, attention_mask=full_mask, position_ids=suf_pos, use_cache=True, **{key: cache}
    )
    bi, ti = action_mask.nonzero(as_tuple=True)
    return hidden.last_hidden_state[bi, ti - start[bi]]


def has_shared_prompts(prompt_lens: torch.Tensor, prefix_ids: torch.Tensor) -> bool:
    """Some rows share a prompt and every prompt has a prefix to share (at least 2 tokens: the
    last one runs with each row's suffix), so :func:`shared_prefix_hidden` saves work.

    Args:
        prompt_lens, prefix_ids: Shape: (B,)
    """
    return bool((prompt_lens >= 2).all()) and len(torch.unique(prefix_ids)) < len(prefix_ids)
