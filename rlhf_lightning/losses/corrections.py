"""Off-policy corrections: rollout-engine / trainer mismatch, reward shaping.

Notation:
    logp_old: the trainer's log-prob of a sampled token before the update.
    logp_beh: the rollout engine's log-prob of the same token when it sampled it (behaviour).
"""

from __future__ import annotations

import torch

from rlhf_lightning.losses.masked import masked_mean


def truncated_importance_weights(
    old_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor, cap: float = 2.0
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Truncated importance sampling for the engine/trainer gap (Yao et al. 2025, "Your efficient RL
    framework secretly brings you off-policy RL training"): ``w_t = min(exp(logp_old - logp_beh), cap)``.

    Args:
        old_logp: Shape: (B, T)
        behaviour_logp: Shape: (B, T)
        mask: Shape: (B, T)
        cap: the truncation.

    Returns:
        detached weights (B, T) and metrics ``gap_mean`` (mean |logp_old - logp_beh| in nats) and
        ``clip_frac`` (share of tokens whose weight was truncated).
    """
    log_w = (old_logp - behaviour_logp).detach()
    w = torch.exp(log_w)
    metrics = {
        "gap_mean": masked_mean(log_w.abs(), mask),
        "clip_frac": masked_mean((w > cap).to(w.dtype), mask),
    }
    return w.clamp(max=cap), metrics


def offpolicy_mask(
    old_logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    token_bounds: tuple[float, float] | None = None,
    seq_threshold: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Drop tokens and sequences that are too far off-policy.

    Token level: keep a token only when ``exp(logp_old - logp_beh)`` lies in ``token_bounds``
    (IcePop-style masking). Sequence level: drop a sequence whose mean log-ratio
    ``mean_t(logp_beh - logp_old)`` (a KL estimate of behaviour vs trainer) exceeds
    ``seq_threshold``.

    Args:
        old_logp, behaviour_logp, mask: Shape: (B, T)

    Returns:
        the reduced mask (B, T) and metrics ``masked_token_frac``, ``masked_seq_frac``.
    """
    keep = mask.bool()
    log_r = (old_logp - behaviour_logp).detach()
    if token_bounds is not None:
        low, high = token_bounds
        r = torch.exp(log_r)
        keep = keep & (r >= low) & (r <= high)
    seq_drop = torch.zeros(mask.shape[0], dtype=torch.bool, device=mask.device)
    if seq_threshold is not None:
        m = mask.to(log_r.dtype)
        seq_kl = (-log_r * m).sum(-1) / m.sum(-1).clamp(min=1.0)
        seq_drop = seq_kl > seq_threshold
        keep = keep & ~seq_drop[:, None]
    valid = mask.bool()
    metrics = {
        "masked_token_frac": ((valid & ~keep).sum() / valid.sum().clamp(min=1)).float(),
        "masked_seq_frac": seq_drop.float().mean() if len(seq_drop) else torch.zeros(()),
    }
    return keep, metrics


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (arXiv 2503.14476, eq. 13), added to the reward.

    0 up to ``max_len - buffer`` tokens, then falling linearly to ``-factor`` at ``max_len``,
    and ``-factor`` beyond.

    Args:
        lengths: generated tokens per trajectory. Shape: (N,)
    """
    start = max_len - buffer
    ramp = (start - lengths.to(torch.float32)) / buffer
    return factor * torch.where(lengths <= start, torch.zeros_like(ramp), ramp.clamp(min=-1.0))
