"""Policy-gradient objectives, one pure function each, registered under their config names.

Contract (every function): ``fn(logp, old_logp, advantages, mask, **hparams) ->
(per_token_loss, metrics)``. The loss is per token and unreduced: aggregation over tokens and
sequences is :func:`rlhf_lightning.losses.aggregate`'s job, so normalisation stays correct
under gradient accumulation. ``metrics`` holds detached scalar tensors.

Notation:
    B: sequences in the (micro-)batch, T: token positions.
    r = exp(logp - old_logp): the per-token importance ratio.
    Clip bounds are offsets from 1 as in the papers: the ratio is kept in
    [1 - clip_low, 1 + clip_high]; ``None`` removes that side's bound.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlhf_lightning.losses.masked import broadcast_advantages, masked_max, masked_mean
from rlhf_lightning.registry import Registry

PolicyLoss = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")


def get_policy_loss(name: str) -> PolicyLoss:
    """The registered objective called ``name`` (``ppo_clip``, ``cispo``, ...)."""
    return POLICY_LOSSES.get(name)


def _bounds(clip_low: float | None, clip_high: float | None) -> tuple[float | None, float | None]:
    low = None if clip_low is None else 1.0 - clip_low
    high = None if clip_high is None else 1.0 + clip_high
    return low, high


def _ratio_metrics(ratio: torch.Tensor, clipped: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    ratio, clipped = ratio.detach(), clipped.detach()
    return {
        "clipfrac": masked_mean(clipped.to(ratio.dtype), mask),
        "ratio_mean": masked_mean(ratio, mask),
        "ratio_max": masked_max(ratio, mask),
    }


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float | None = 0.2,
    clip_high: float | None = 0.2,
    clip_ratio_c: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate (Schulman et al. 2017, eq. 7) with decoupled bounds.

    ``loss = -min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)``. Separate bounds give
    GRPO (0.2/0.2), DAPO's clip-higher (0.2/0.28, arXiv 2503.14476 eq. 10) and Dr.GRPO.
    ``clip_ratio_c`` (> 1) adds the dual-clip bound for negative advantages
    (Ye et al. 2020, arXiv 1912.09729): ``loss = min(loss, -clip_ratio_c * A)`` where A < 0.

    Args:
        logp: log pi_theta of the taken tokens. Shape: (B, T)
        old_logp: log pi_old of the same tokens (no gradient). Shape: (B, T)
        advantages: Shape: (B,) or (B, T)
        mask: 1 on action tokens. Shape: (B, T)

    Returns:
        per-token loss (B, T) and metrics ``clipfrac`` (share of action tokens whose
        gradient the clip removed), ``ratio_mean``, ``ratio_max``.
    """
    adv = broadcast_advantages(advantages, logp)
    ratio = torch.exp(logp - old_logp.detach())
    low, high = _bounds(clip_low, clip_high)
    unclipped = -ratio * adv
    clipped = -torch.clamp(ratio, low, high) * adv
    loss = torch.maximum(unclipped, clipped)
    if clip_ratio_c is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -clip_ratio_c * adv), loss)
    return loss, _ratio_metrics(ratio, clipped > unclipped, mask)


@POLICY_LOSSES.register("cispo")
def cispo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float | None = None,
    clip_high: float | None = 4.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO: clipped importance-sampling-weight policy optimisation (MiniMax-M1, arXiv 2506.13585, eq. 4-5).

    ``loss = -sg(clamp(r, 1 - clip_low, 1 + clip_high)) * A * logp``. Unlike PPO-clip, no
    token's gradient is dropped: the importance weight is clipped and detached, and the
    gradient flows through ``logp`` only. The paper imposes no lower bound
    (``clip_low=None``) and tunes only the upper one; the default ``clip_high=4.0`` caps the
    weight at 5.0, the same cap as TRL's ``epsilon_high=5.0`` (an absolute cap there).

    Args:
        logp: Shape: (B, T)
        old_logp: Shape: (B, T)
        advantages: Shape: (B,) or (B, T)
        mask: Shape: (B, T)

    Returns:
        per-token loss (B, T) and metrics; ``clipfrac`` is the share of action tokens whose
        weight was clipped.
    """
    adv = broadcast_advantages(advantages, logp)
    ratio = torch.exp(logp.detach() - old_logp.detach())
    low, high = _bounds(clip_low, clip_high)
    weight = torch.clamp(ratio, low, high)
    loss = -weight * adv * logp
    return loss, _ratio_metrics(ratio, weight != ratio, mask)


@POLICY_LOSSES.register("reinforce")
def reinforce_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """REINFORCE (Williams 1992): ``loss = -A * logp``, no ratio; on-policy, one epoch.

    Args:
        logp: Shape: (B, T)
        old_logp: only for the ratio metrics. Shape: (B, T)
        advantages: Shape: (B,) or (B, T)
        mask: Shape: (B, T)
    """
    adv = broadcast_advantages(advantages, logp)
    ratio = torch.exp(logp.detach() - old_logp.detach())
    return -adv * logp, _ratio_metrics(ratio, torch.zeros_like(mask, dtype=torch.bool), mask)
