"""Reduction of a per-token loss to a scalar, kept apart from the objectives.

Every mode accepts the normaliser of the whole accumulation window (``num_tokens``,
``num_seqs``), so summing the micro-batch losses gives exactly the full batch's loss.
"""

from __future__ import annotations

import torch

AGGREGATION_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")


def aggregate(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token_mean",
    *,
    num_tokens: torch.Tensor | float | None = None,
    num_seqs: torch.Tensor | float | None = None,
    max_len: int | None = None,
) -> torch.Tensor:
    """Reduce ``per_token_loss`` over the action tokens in ``mask``.

    Modes:
        ``token_mean``: sum over all action tokens / number of action tokens (DAPO, eq. 8).
        ``seq_mean_token_mean``: each sequence's token mean, averaged over sequences (GRPO,
            DeepSeekMath eq. 3).
        ``seq_mean_token_sum``: each sequence's token sum, averaged over sequences.
        ``seq_mean_token_sum_norm``: token sums divided by the constant ``max_len``, averaged
            over sequences (Dr.GRPO, arXiv 2503.20783): no length bias.

    Args:
        per_token_loss: Shape: (B, T)
        mask: 1 on action tokens. Shape: (B, T)
        mode: one of ``AGGREGATION_MODES``.
        num_tokens: ``token_mean``'s denominator for a whole accumulation window (summed over
            micro-batches and ranks); default: this batch's action tokens.
        num_seqs: the sequence modes' denominator, likewise; default: B.
        max_len: required by ``seq_mean_token_sum_norm``.

    Returns:
        the scalar loss.
    """
    mask = mask.to(per_token_loss.dtype)
    token_sum = (per_token_loss * mask).sum(-1)  # (B,)
    seqs = per_token_loss.shape[0] if num_seqs is None else num_seqs
    if mode == "token_mean":
        denom = mask.sum().clamp(min=1.0) if num_tokens is None else num_tokens
        return token_sum.sum() / denom
    if mode == "seq_mean_token_mean":
        return (token_sum / mask.sum(-1).clamp(min=1.0)).sum() / seqs
    if mode == "seq_mean_token_sum":
        return token_sum.sum() / seqs
    if mode == "seq_mean_token_sum_norm":
        if max_len is None or max_len <= 0:
            raise ValueError(f"aggregate mode 'seq_mean_token_sum_norm' needs max_len > 0, got {max_len}")
        return token_sum.sum() / max_len / seqs
    raise ValueError(f"unknown aggregation mode {mode!r}; valid modes: {', '.join(AGGREGATION_MODES)}")
