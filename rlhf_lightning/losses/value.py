"""The critic's loss."""

from __future__ import annotations

import torch

from rlhf_lightning.losses.masked import masked_mean


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_range: float | None = 0.2,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped value loss (Schulman et al. 2017; as in OpenAI baselines ppo2).

    ``0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)``; ``clip_range=None`` gives
    the plain squared error.

    Args:
        values: the critic's current predictions. Shape: (B, S)
        old_values: predictions when the rollout was scored (no gradient). Shape: (B, S)
        returns: regression targets. Shape: (B, S)
        mask: valid steps. Shape: (B, S)

    Returns:
        per-step loss (B, S) and metrics ``vf_clipfrac`` (share of steps where the clipped
        term was the larger one).
    """
    unclipped = (values - returns).square()
    if clip_range is None:
        return 0.5 * unclipped, {"vf_clipfrac": torch.zeros((), device=values.device)}
    old = old_values.detach()
    clipped_v = old + (values - old).clamp(-clip_range, clip_range)
    clipped = (clipped_v - returns).square()
    loss = 0.5 * torch.maximum(unclipped, clipped)
    return loss, {"vf_clipfrac": masked_mean((clipped > unclipped).to(values.dtype).detach(), mask)}
