"""The exact reverse KL from a student to a teacher over the whole vocabulary, per position,
straight from both models' hidden states: never a ``(N, V)`` logits tensor of either model.

``KL(p_s || p_t) = sum_v p_s(v) (log p_s(v) - log p_t(v))`` with ``p = softmax((h W^T + b) / T)``.
As :mod:`~rlhf_lightning.ops.logprobs`, the rows go in tiles of ``chunk_rows``: each tile
computes both models' ``(chunk_rows, V)`` logits, its KL, and drops them; backward recomputes
them. Only the student gets a gradient (the teacher is a fixed target):

    dKL / dz_s(v) = p_s(v) (log p_s(v) - log p_t(v) - KL) / T

Cost against the sampled-token estimate ``log p_s(y) - log p_t(y)``: per tile, one more
``(chunk_rows, H) x (H, V)`` product forward and one backward (the teacher's logits), and the
teacher's hidden rows ``(N, H)`` kept until backward; the teacher's transformer body runs in
every update micro-batch instead of once per rollout batch.
"""

from __future__ import annotations

import torch

from rlhf_lightning.ops.logprobs import HeadGrads, _tile_logits, resolve_chunk_rows


class _ChunkedReverseKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_s, w_s, b_s, h_t, w_t, b_t, temperature, chunk_rows, fp32):
        n = h_s.shape[0]
        out_dtype = torch.promote_types(h_s.dtype, torch.float32) if fp32 else h_s.dtype
        kl = h_s.new_empty(n, dtype=out_dtype)
        lse_s = h_s.new_empty(n, dtype=out_dtype)
        lse_t = h_s.new_empty(n, dtype=out_dtype)
        for s in range(0, n, chunk_rows):
            e = s + chunk_rows
            log_ps = _tile_logits(h_s[s:e], w_s, b_s, temperature, fp32)
            log_pt = _tile_logits(h_t[s:e], w_t, b_t, temperature, fp32).to(log_ps.dtype)
            lse_s[s:e], lse_t[s:e] = torch.logsumexp(log_ps, -1), torch.logsumexp(log_pt, -1)
            log_ps.sub_(lse_s[s:e, None])
            log_pt.sub_(lse_t[s:e, None])
            kl[s:e] = (log_ps.exp() * (log_ps - log_pt)).sum(-1)
        ctx.save_for_backward(h_s, w_s, b_s, h_t, w_t, b_t, lse_s, lse_t, kl)
        ctx.temperature, ctx.chunk_rows, ctx.fp32 = temperature, chunk_rows, fp32
        ctx.set_materialize_grads(False)
        return kl

    @staticmethod
    def backward(ctx, grad_kl):
        h_s, w_s, b_s, h_t, w_t, b_t, lse_s, lse_t, kl = ctx.saved_tensors
        nothing = (None,) * 9
        if grad_kl is None:
            return nothing
        t, rows = ctx.temperature, ctx.chunk_rows
        grads = HeadGrads(h_s, w_s, b_s, ctx.needs_input_grad[:3])
        for s in range(0, h_s.shape[0], rows):
            e = s + rows
            g = _tile_logits(h_s[s:e], w_s, b_s, t, ctx.fp32).sub_(lse_s[s:e, None])  # log p_s
            log_pt = _tile_logits(h_t[s:e], w_t, b_t, t, ctx.fp32).to(g.dtype).sub_(lse_t[s:e, None])
            diff = (g - log_pt).sub_(kl[s:e, None])  # log p_s - log p_t - KL
            del log_pt
            g.exp_().mul_(diff).mul_(grad_kl[s:e, None].to(g.dtype))
            del diff
            grads.add(g, s, t)
        return *grads.result(), None, None, None, None, None, None


def chunked_reverse_kl(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_rows: int | None = None,
    cast_to_fp32: bool = True,
) -> torch.Tensor:
    """Per-row ``KL(student || teacher)`` over the full vocabulary (see the module's docstring),
    differentiable in the student's ``hidden``, ``weight`` and ``bias`` only.

    Args:
        hidden: the student's final hidden states. Shape: (..., H_s)
        weight: the student's lm-head weight. Shape: (V, H_s)
        teacher_hidden: the teacher's at the same positions (no gradient). Shape: (..., H_t)
        teacher_weight: Shape: (V, H_t), the same V (one tokenizer)
        bias, teacher_bias: Shape: (V,) or None
        temperature: both models' logits are divided by it (> 0).
        chunk_rows: rows per tile; ``None`` auto-sizes as the log-probs op.
        cast_to_fp32: compute in fp32 (recommended under bf16).

    Returns:
        KL per position, Shape: (...)
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if weight.shape[0] != teacher_weight.shape[0]:
        raise ValueError(
            f"the student's head has {weight.shape[0]} tokens and the teacher's {teacher_weight.shape[0]}: "
            "the full-vocabulary KL needs one vocabulary (use algo.distill.estimator=sampled)"
        )
    if hidden.shape[:-1] != teacher_hidden.shape[:-1]:
        raise ValueError(
            f"student rows {tuple(hidden.shape[:-1])} and teacher rows {tuple(teacher_hidden.shape[:-1])} differ"
        )
    lead = hidden.shape[:-1]
    rows = resolve_chunk_rows(chunk_rows, weight.shape[0])
    h_s = hidden.reshape(-1, hidden.shape[-1])
    h_t = teacher_hidden.detach().reshape(-1, teacher_hidden.shape[-1])
    w_t = teacher_weight.detach()
    b_t = None if teacher_bias is None else teacher_bias.detach()
    kl = _ChunkedReverseKL.apply(h_s, weight, bias, h_t, w_t, b_t, float(temperature), rows, cast_to_fp32)
    return kl.reshape(lead)
