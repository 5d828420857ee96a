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


class HeadGrads:
    """The lm head's input gradients (hidden rows, weight, bias), accumulated tile by tile from
    each tile's gradient at its logits: whatever the loss over the logits, a tile's backward
    through ``h @ W.T + b`` is the same products. The weight's and bias's accumulate in >= fp32.

    Args:
        hidden: Shape: (N, H); weight: Shape: (V, H); bias: Shape: (V,) or None
        needs: whether each of the three needs a gradient (``ctx.needs_input_grad[:3]``).
    """

    def __init__(
        self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, needs: tuple[bool, ...]
    ) -> None:
        self.hidden, self.weight, self.bias = hidden, weight, bias
        acc = torch.promote_types(weight.dtype, torch.float32)
        self.h = torch.zeros_like(hidden) if needs[0] else None
        self.w = torch.zeros_like(weight, dtype=acc) if needs[1] else None
        self.b = torch.zeros_like(bias, dtype=acc) if needs[2] and bias is not None else None

    def add(self, g: torch.Tensor, start: int, temperature: float) -> None:
        """Tile ``[start, start + len(g))``'s share; ``g`` (c, V) is the loss's gradient at its
        tempered logits ``z / T`` (divided by ``T`` here, in place)."""
        end = start + g.shape[0]
        if temperature != 1.0:
            g.div_(temperature)
        if self.h is not None:
            self.h[start:end] = (g.to(self.weight.dtype) @ self.weight).to(self.hidden.dtype)
        if self.w is not None:
            self.w.addmm_(g.t(), self.hidden[start:end].to(g.dtype))
        if self.b is not None:
            self.b += g.sum(0)

    def result(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """(grad hidden, grad weight, grad bias), each in its input's dtype (None: not needed)."""
        w = None if self.w is None else self.w.to(self.weight.dtype)
        b = None if self.b is None or self.bias is None else self.b.to(self.bias.dtype)
        return self.h, w, b


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
        grads = HeadGrads(hidden, weight, bias, ctx.needs_input_grad[:3])
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
            grads.add(g, s, t)
        return *grads.result(), None, None, None, None, None


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
