"""Advantage estimators, registered under their config names.

Outcome estimators (``kind="outcome"``): ``fn(rewards, group_ids, **hparams) -> advantages``,
all ``(N,)``; ``group_ids`` marks which samples answer the same prompt; groups may differ in
size. An estimator's hyper-parameters are the keyword arguments registered as ``params``
(the algorithm config's ``advantage_<name>`` sets ``<name>``). ``gae`` (``kind="critic"``) needs a critic's values and is PPO's.

Notation:
    N: trajectories in the rollout batch; G_i: the size of sample i's group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rlhf_lightning.runtime.registry import Registry

AdvantageEstimator = Callable[..., Any]  # outcome estimators return (N,); gae returns (advantages, returns)
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


@ADVANTAGE_ESTIMATORS.register("grpo", kind="outcome", params=("scale",))
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


@ADVANTAGE_ESTIMATORS.register("mean_only", kind="outcome", params=())
@ADVANTAGE_ESTIMATORS.register("dr_grpo", kind="outcome", params=())
def dr_grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Dr.GRPO (arXiv 2503.20783, eq. 3): ``A_i = r_i - mean_group(r)``, no std division.

    Args:
        rewards: Shape: (N,)
        group_ids: Shape: (N,)
    """
    return grpo_advantages(rewards, group_ids, scale="none")


@ADVANTAGE_ESTIMATORS.register("rloo", kind="outcome", params=())
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


def _batch_whiten(x: torch.Tensor, eps: float) -> torch.Tensor:
    if x.numel() < 2:
        return torch.zeros_like(x)
    return (x - x.mean()) / (x.std() + eps)


@ADVANTAGE_ESTIMATORS.register("rebn", kind="outcome", params=())
def rebn_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, *, eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE with return batch normalisation (ReBN; GEM, arXiv 2510.01051, sec. 3):
    ``A_i = (R_i - mean_batch(R)) / (std_batch(R) + eps)``; groups are not used.

    Args:
        rewards: episode returns. Shape: (N,)
        group_ids: ignored. Shape: (N,)
    """
    return _batch_whiten(rewards, eps)


@ADVANTAGE_ESTIMATORS.register("reinforce_pp", kind="outcome", params=())
def reinforce_pp_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, *, eps: float = 1e-6
) -> torch.Tensor:
    """REINFORCE++-baseline (Hu et al. 2025, arXiv 2501.03262, sec. 3.2): subtract the group
    mean, then whiten globally over the batch:
    ``A_i = norm_batch(r_i - mean_group(r))``.

    Args:
        rewards: Shape: (N,)
        group_ids: Shape: (N,)
    """
    _, mean, _ = group_stats(rewards, group_ids)
    return _batch_whiten(rewards - mean.to(rewards.dtype), eps)


@ADVANTAGE_ESTIMATORS.register("gdpo", kind="outcome", params=(), decoupled=True)
def gdpo_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    components: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GDPO: group reward-decoupled normalisation (Liu et al. 2026, NVIDIA, arXiv 2601.05242): each
    reward component is normalised within its group before the weighted sum, and the sum is then
    normalised over the batch:
    ``A_i = norm_batch(sum_k w_k * (r_ik - mean_group(r_k)) / (std_group(r_k) + eps))``.

    GRPO on the weighted sum normalises ``sum_k w_k r_k`` at once, so distinct combinations of
    component rewards with the same sum get the same advantage (a group scoring (1, 0) and
    (0, 1) on two rewards has no signal); GDPO keeps each component's own contrast. The
    algorithm module hands each trajectory's reward terms (``components``: the env's return and
    each ``reward`` component's score, ``weights``: ``reward.weights``); without them the
    summed return is the one component (GRPO's advantages, then batch-normalised).

    Args:
        rewards: the summed return per trajectory (used when ``components`` is None). Shape: (N,)
        group_ids: Shape: (N,)
        components: each term's return per trajectory. Shape: (N, C) or None
        weights: each term's weight (default 1). Shape: (C,) or None

    Returns:
        Shape: (N,)
    """
    parts = rewards[:, None] if components is None else components.to(rewards.dtype)
    w = (
        torch.ones(parts.shape[1], dtype=parts.dtype, device=parts.device)
        if weights is None
        else weights.to(parts.dtype)
    )
    total = torch.zeros_like(rewards)
    for k in range(parts.shape[1]):
        _, mean, std = group_stats(parts[:, k], group_ids)
        total = total + w[k] * (parts[:, k] - mean.to(parts.dtype)) / (std.to(parts.dtype) + eps)
    return _batch_whiten(total, eps)


@ADVANTAGE_ESTIMATORS.register("gae", kind="critic")
def gae_advantages(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
    bootstrap: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016, arXiv 1506.02438, eq. 16) over steps.

    A step is a generated turn (turn-level, multi-turn) or an action token (token-level,
    reward on the last token). Each row's valid steps are a prefix given by ``mask``.
    ``delta_k = r_k + gamma * V_{k+1} - V_k``, ``A_k = sum_j (gamma * lam)^j delta_{k+j}``,
    returns ``R_k = A_k + V_k``. After a row's last step, ``V_{n}`` is ``bootstrap`` (the
    critic's value of the state where a truncated episode stopped) or 0 (a terminal state).

    Args:
        rewards: per-step rewards. Shape: (B, S)
        values: per-step values (no gradient). Shape: (B, S)
        mask: valid steps, a prefix of each row. Shape: (B, S)
        bootstrap: value after the last step; 0 for terminated rows. Shape: (B,) or None

    Returns:
        (advantages, returns), each Shape: (B, S), 0 outside the mask.
    """
    m = mask.to(values.dtype)
    v = values.detach() * m
    r = rewards * m
    # V_{k+1}: the next step's value; after each row's last step, the bootstrap value.
    next_v = torch.cat([v[:, 1:], torch.zeros_like(v[:, :1])], dim=1)
    if bootstrap is not None:
        last = (mask.long().sum(-1) - 1).clamp(min=0)  # (B,)
        tail = torch.zeros_like(v).scatter(1, last[:, None], bootstrap.detach().to(v.dtype)[:, None])
        next_v = next_v + tail * m
    adv = torch.zeros_like(v)
    running = torch.zeros_like(v[:, 0])
    for k in reversed(range(v.shape[1])):
        delta = r[:, k] + gamma * next_v[:, k] - v[:, k]
        running = (delta + gamma * lam * running) * m[:, k]
        adv[:, k] = running
    return adv, (adv + v) * m


def postprocess_advantages(
    advantages: torch.Tensor,
    *,
    whiten: bool = False,
    clip: float | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Optional whitening over the batch and clipping to [-clip, clip].

    Args:
        advantages: Shape: (N,)
    """
    out = _batch_whiten(advantages, eps) if whiten else advantages
    return out.clamp(-clip, clip) if clip is not None else out


def informative_groups(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """True for samples whose group's rewards are not all equal (DAPO's dynamic-sampling filter).

    Args:
        rewards, group_ids: Shape: (N,)
    """
    _, inverse = torch.unique(group_ids, return_inverse=True)
    k = int(inverse.max()) + 1 if inverse.numel() else 0
    lo = torch.full((k,), float("inf"), dtype=rewards.dtype, device=rewards.device).scatter_reduce(
        0, inverse, rewards, "amin"
    )
    hi = torch.full((k,), float("-inf"), dtype=rewards.dtype, device=rewards.device).scatter_reduce(
        0, inverse, rewards, "amax"
    )
    return (hi > lo)[inverse]
