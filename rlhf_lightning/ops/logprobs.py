"""Memory-bounded log-probs straight from hidden states: never materialise ``(B, T, V)`` logits.

The flattened rows are processed in tiles of ``chunk_rows``: each tile computes its
``(chunk_rows, V)`` logits, the log-sum-exp (in fp32 by default) and the gather, then drops
them. Backward recomputes each tile's logits, so nothing of size V is saved for autograd.
"""

from __future__ import annotations

from typing import Literal, overload

import torch

WORKSPACE_BYTES = 256 * 2**20  # auto tile: about 256 MB of fp32 logits
MIN_AUTO_ROWS, MAX_AUTO_ROWS = 128, 4096


def resolve_chunk_rows(chunk_rows: int | None, vocab_size: int) -> int:
    """``None``: rows giving ~256 MB of fp32 logits, clamped to [128, 4096]; else ``chunk_rows``."""
    if chunk_rows is None:
        return max(MIN_AUTO_ROWS, min(MAX_AUTO_ROWS, WORKSPACE_BYTES // (4 * vocab_size)))
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows <= 0:
        raise ValueError(f"chunk_rows must be a positive int or None (auto), got {chunk_rows!r}")
    return chunk_rows


def _tile_logits(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float, fp32: bool
):
    logits = h @ weight.t()
    if bias is not None:
        logits = logits + bias
    if fp32 and logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return logits / temperature if temperature != 1.0 else logits


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_rows, fp32, want_entropy):
        n = hidden.shape[0]
        out_dtype = torch.promote_types(hidden.dtype, torch.float32) if fp32 else hidden.dtype
        logp = hidden.new_empty(n, dtype=out_dtype)
        lse = hidden.new_empty(n, dtype=out_dtype)
        entropy = (
            hidden.new_empty(n, dtype=out_dtype) if want_entropy else hidden.new_empty(0, dtype=out_dtype)
        )
        for s in range(0, n, chunk_rows):
            z = _tile_logits(hidden[s : s + chunk_rows], weight, bias, temperature, fp32)  # (c, V)
            tile_lse = torch.logsumexp(z, dim=-1)
            lse[s : s + chunk_rows] = tile_lse
            logp[s : s + chunk_rows] = z.gather(-1, targets[s : s + chunk_rows, None]).squeeze(-1) - tile_lse
            if want_entropy:
                p = torch.exp(z - tile_lse[:, None])
                entropy[s : s + chunk_rows] = tile_lse - (p * z).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.temperature, ctx.chunk_rows, ctx.fp32 = temperature, chunk_rows, fp32
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        t, rows = ctx.temperature, ctx.chunk_rows
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        grad_h = torch.zeros_like(hidden) if need_h else None
        acc = torch.promote_types(weight.dtype, torch.float32)  # accumulate tiles in >= fp32
        grad_w = torch.zeros_like(weight, dtype=acc) if need_w else None
        grad_b = torch.zeros_like(bias, dtype=acc) if need_b else None
        for s in range(0, hidden.shape[0], rows):
            h = hidden[s : s + rows]
            # Recompute the tile's logits, then turn them into the gradient in place: one (c, V)
            # buffer (two with an entropy gradient).
            g = _tile_logits(h, weight, bias, t, ctx.fp32).sub_(lse[s : s + rows, None])  # log q
            ent_term = None
            if grad_entropy is not None:
                # d H / dz_j = -p_j (log p_j + H): keep (log q + H) before q overwrites it
                ent_term = (g + entropy[s : s + rows, None]).mul_(
                    grad_entropy[s : s + rows, None].to(g.dtype)
                )
            g.exp_()  # q = softmax(z)
            if ent_term is not None:
                ent_term.mul_(g)  # g_H * q * (log q + H)
            if grad_logp is not None:
                # d logp / dz = onehot(target) - q
                g_lp = grad_logp[s : s + rows, None].to(g.dtype)
                g.mul_(-g_lp).scatter_add_(-1, targets[s : s + rows, None], g_lp)
            else:
                g.zero_()
            if ent_term is not None:
                g.sub_(ent_term)
                del ent_term
            if t != 1.0:
                g.div_(t)
            if need_h:
                grad_h[s : s + rows] = (g.to(weight.dtype) @ weight).to(hidden.dtype)
            if need_w:
                grad_w.addmm_(g.t(), h.to(g.dtype))
            if need_b:
                grad_b += g.sum(0)
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        if grad_b is not None:
            grad_b = grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None


@overload
def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_ids: torch.Tensor,
    bias: torch.Tensor | None = ...,
    temperature: float = ...,
    chunk_rows: int | None = ...,
    cast_to_fp32: bool = ...,
    return_entropy: Literal[False] = ...,
) -> torch.Tensor: ...


@overload
def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_ids: torch.Tensor,
    bias: torch.Tensor | None = ...,
    temperature: float = ...,
    chunk_rows: int | None = ...,
    cast_to_fp32: bool = ...,
    *,
    return_entropy: Literal[True],
) -> tuple[torch.Tensor, torch.Tensor]: ...


@overload
def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_ids: torch.Tensor,
    bias: torch.Tensor | None = ...,
    temperature: float = ...,
    chunk_rows: int | None = ...,
    cast_to_fp32: bool = ...,
    return_entropy: bool = ...,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_ids: torch.Tensor,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_rows: int | None = None,
    cast_to_fp32: bool = True,
    return_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of ``target_ids`` under ``softmax((hidden @ weight.T + bias) / temperature)``.

    Args:
        hidden: final hidden states. Shape: (..., H), e.g. (B, T, H) or (N, H)
        weight: lm-head weight (the tied embedding for tied models). Shape: (V, H)
        target_ids: Shape: (...), matching ``hidden`` without its last dim
        bias: Shape: (V,) or None
        temperature: logits are divided by it (> 0).
        chunk_rows: rows per tile; ``None`` auto-sizes (see :func:`resolve_chunk_rows`).
        cast_to_fp32: compute log-sum-exp and outputs in fp32 (recommended under bf16).
        return_entropy: also return each position's entropy (differentiable).

    Returns:
        log-probs, Shape: (...); with ``return_entropy`` a tuple (log-probs, entropy).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    rows = resolve_chunk_rows(chunk_rows, weight.shape[0])
    lead = target_ids.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    tgt = target_ids.reshape(-1).long()
    logp, entropy = _ChunkedLogprobs.apply(
        h, weight, bias, tgt, float(temperature), rows, cast_to_fp32, return_entropy
    )
    if return_entropy:
        return logp.reshape(lead), entropy.reshape(lead)
    return logp.reshape(lead)
