"""Advantage estimators, registered under their config names.

Outcome estimators: ``fn(rewards, group_ids, **hparams) -> advantages``, all ``(N,)``.
``group_ids`` marks which samples answer the same prompt; groups may differ in size.

Notation:
    N: trajectories in the rollout batch; G_i: the size of sample i's group.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlhf_lightning.registry import Registry

AdvantageEstimator = Callable[..., torch.Tensor]
ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The registered estimator called ``name`` (``grpo``, ``rloo``, ...)."""
    return ADVANTAGE_ESTIMATORS.get(name)


def group_stats(
    values: torch.Tensor, group_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample group size, group mean and unbiased group std (0 for singleton groups).

    Args:
        values: Shape: (N,)
        group_ids: any integer labels. Shape: (N,)

    Returns:
        (count, mean, std), each broadcast back to the samples. Shape: (N,) each.
    """
    _, inverse = torch.unique(group_ids, return_inverse=True)
    k = int(inverse.max()) + 1 if inverse.numel() else 0
    v = values.to(torch.float64) if values.dtype == torch.float64 else values.float()
    count = torch.zeros(k, dtype=v.dtype, device=v.device).index_add_(0, inverse, torch.ones_like(v))
    total = torch.zeros_like(count).index_add_(0, inverse, v)
    mean = total / count
    sq = torch.zeros_like(count).index_add_(0, inverse, (v - mean[inverse]).square())
    std = torch.sqrt(sq / (count - 1).clamp(min=1.0))
    return count[inverse], mean[inverse], std[inverse]


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    scale: str = "group",
    eps: float = 1e-6,
) -> torch.Tensor:
    """Group-relative advantages (GRPO, DeepSeekMath arXiv 2402.03300, sec. 4.1.2).

    ``A_i = (r_i - mean_group(r)) / (std + eps)`` where the std is the group's
    (``scale="group"``, the paper), the whole batch's (``scale="batch"``, as in
    REINFORCE++-baseline / Hu et al. 2025), or 1 (``scale="none"``: Dr.GRPO, arXiv 2503.20783).

    Args:
        rewards: scalar return per trajectory. Shape: (N,)
        group_ids: Shape: (N,)

    Returns:
        Shape: (N,)
    """
    _, mean, std = group_stats(rewards, group_ids)
    centred = rewards - mean.to(rewards.dtype)
    if scale == "group":
        return centred / (std.to(rewards.dtype) + eps)
    if scale == "batch":
        return centred / (rewards.std() + eps) if rewards.numel() > 1 else torch.zeros_like(rewards)
    if scale == "none":
        return centred
    raise ValueError(f"grpo advantages: unknown scale {scale!r}; valid: group, batch, none")


@ADVANTAGE_ESTIMATORS.register("dr_grpo")
def dr_grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Dr.GRPO (arXiv 2503.20783, eq. 3): ``A_i = r_i - mean_group(r)``, no std division.

    Args:
        rewards: Shape: (N,)
        group_ids: Shape: (N,)
    """
    return grpo_advantages(rewards, group_ids, scale="none")


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """REINFORCE leave-one-out (Ahmadian et al. 2024, arXiv 2402.14740, eq. 5).

    ``A_i = r_i - (sum_group(r) - r_i) / (G_i - 1)``; 0 for singleton groups.

    Args:
        rewards: Shape: (N,)
        group_ids: Shape: (N,)
    """
    count, mean, _ = group_stats(rewards, group_ids)
    count, mean = count.to(rewards.dtype), mean.to(rewards.dtype)
    others = (mean * count - rewards) / (count - 1).clamp(min=1.0)
    return torch.where(count > 1, rewards - others, torch.zeros_like(rewards))
