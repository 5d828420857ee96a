"""Step-level group advantages for multi-turn episodes: GiGPO (Feng et al. 2025, "Group-in-Group
Policy Optimization for LLM Agent Training", arXiv 2505.10978, sec. 4).

An episode-level advantage says how good a whole episode was against its group (GRPO's); it
credits a good episode's bad moves as much as its good ones. GiGPO adds a step-level advantage
computed among the turns of the same group's episodes that started from the same state (an
*anchor state*, e.g. the same board; ``TrajectoryBatch.state_ids``): there the episodes differ
only in the move taken, so comparing what followed each move credits the move itself. It needs no critic
and no extra rollouts: the groups are found after the fact in the rollout batch.

For episode i of a group and its turn k (a step), with per-turn rewards r_{i,k}:

    A^E_i    = (R_i - mean_group(R)) / F                  R_i = sum_k r_{i,k}
    R_{i,k}  = sum_{j >= k} gamma^(j - k) r_{i,j}          (the discounted return from step k)
    A^S_i,k  = (R_{i,k} - mean_{anchor(i,k)}(R)) / F       over the steps of the group with
                                                           the same state as step (i, k)
    A_i,k    = A^E_i + omega * A^S_i,k                     on every token of turn k

``F`` is the group's (or anchor group's) unbiased std plus ``eps`` (``scale="group"``, the
paper's default) or 1 (``scale="none"``, its variant without the std, as Dr.GRPO). A step alone
in its anchor group gets ``A^S = 0``. The paper's settings: ``omega = 1``, ``gamma = 0.95``.

With one turn per episode every turn-0 state is the group's prompt, so the anchor group is the
episode group, ``R_{i,0} = R_i`` and ``A = (1 + omega) * GRPO's advantage``.

The registry entry is ``kind="outcome"`` (a group estimator without a critic) with
``per_turn=True``: it takes per-turn rewards and each turn's state id
(:attr:`~rlhf_lightning.records.trajectory.TrajectoryBatch.state_ids`) and returns per-turn
advantages, which :func:`turn_advantages_to_tokens` spreads over each turn's tokens.

Notation:
    B: episodes in the rollout batch; K: the most turns of an episode; T: token positions (L-1).
"""

from __future__ import annotations

import torch

from rlhf_lightning.losses.advantages import ADVANTAGE_ESTIMATORS, grpo_advantages

SCALES = ("group", "none")


def turn_mask(num_turns: torch.Tensor, turns: int) -> torch.Tensor:
    """True for the turns an episode played.

    Args:
        num_turns: Shape: (B,)
        turns: K, the width of the per-turn tensors.

    Returns:
        Shape: (B, K)
    """
    return torch.arange(turns, device=num_turns.device)[None, :] < num_turns[:, None]


def discounted_turn_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """The discounted return from each turn: ``R_k = r_k + gamma * R_{k+1}`` (0 after the last).

    Args:
        rewards: per-turn rewards. Shape: (B, K)
        mask: the turns played, a prefix of each row. Shape: (B, K)

    Returns:
        Shape: (B, K), 0 outside the mask.
    """
    m = mask.to(rewards.dtype)
    out = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for k in reversed(range(rewards.shape[1])):
        running = (rewards[:, k] + gamma * running) * m[:, k]
        out[:, k] = running
    return out


def anchor_state_groups(group_ids: torch.Tensor, state_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A label per step: steps of one episode group that started from the same state share it.

    Args:
        group_ids: Shape: (B,)
        state_ids: each turn's state (-1: none known). Shape: (B, K)
        mask: the turns played. Shape: (B, K)

    Returns:
        labels 0..(anchor groups - 1), -1 where the turn was not played or has no state.
        Shape: (B, K)
    """
    valid = mask & (state_ids >= 0)
    pairs = torch.stack([group_ids[:, None].expand_as(state_ids), state_ids], dim=-1)[valid]  # (S, 2)
    labels = torch.full_like(state_ids, -1)
    if pairs.numel():
        labels[valid] = torch.unique(pairs, dim=0, return_inverse=True)[1]
    return labels


def shared_anchor_fraction(labels: torch.Tensor) -> torch.Tensor:
    """The fraction of steps after the first turn whose anchor group holds another step (the
    steps that get a step-level signal beyond turn 0's, where the group's prompt is shared).

    Args:
        labels: from :func:`anchor_state_groups`. Shape: (B, K)

    Returns:
        Shape: () (0 when no episode has a second turn)
    """
    later = labels[:, 1:]
    valid = later >= 0
    sizes = torch.bincount(labels[labels >= 0], minlength=1)
    shared = (sizes[later.clamp(min=0)] > 1) & valid
    return shared.sum().float() / valid.sum().clamp(min=1).float()


@ADVANTAGE_ESTIMATORS.register(
    "gigpo", kind="outcome", params=("scale", "step_weight", "gamma"), per_turn=True
)
def gigpo_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    state_ids: torch.Tensor,
    num_turns: torch.Tensor,
    returns: torch.Tensor | None = None,
    scale: str = "group",
    step_weight: float = 1.0,
    gamma: float = 0.95,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GiGPO (Feng et al. 2025, arXiv 2505.10978): per turn, ``A_ik = A^E_i + step_weight *
    A^S_ik``, the episode's group-relative advantage plus the turn's among the turns of its group
    that started from the same state (an anchor state), over discounted returns from each turn
    (``gamma``); a multi-turn env's per-move credit (formulas in the module docstring).

    Args:
        rewards: per-turn rewards, as the env (and reward shaping) gave them. Shape: (B, K)
        group_ids: episodes of one task share an id. Shape: (B,)
        state_ids: each turn's state; -1 where none (no step-level term). Shape: (B, K)
        num_turns: turns played per episode. Shape: (B,)
        returns: episode returns for the episode level (default: the sum of ``rewards``; the
            scorer may have added a KL penalty to it). Shape: (B,) or None
        scale: ``group`` (divide by the std, the paper) or ``none`` (no std).
        step_weight: omega, the step level's weight.
        gamma: the discount of the step-level returns.

    Returns:
        per-turn advantages, 0 after an episode's last turn. Shape: (B, K)
    """
    if scale not in SCALES:
        raise ValueError(f"gigpo advantages: unknown scale {scale!r}; valid: {', '.join(SCALES)}")
    mask = turn_mask(num_turns, rewards.shape[1])
    episode_returns = (rewards * mask).sum(-1) if returns is None else returns.to(rewards.dtype)
    episode = grpo_advantages(episode_returns, group_ids, scale=scale, eps=eps)  # (B,)
    step_returns = discounted_turn_returns(rewards, mask, gamma)  # (B, K)
    labels = anchor_state_groups(group_ids, state_ids, mask)
    placed = labels >= 0
    step = torch.zeros_like(rewards)
    if placed.any():
        step[placed] = grpo_advantages(step_returns[placed], labels[placed], scale=scale, eps=eps)
    return (episode[:, None] + step_weight * step) * mask.to(rewards.dtype)


def turn_advantages_to_tokens(advantages: torch.Tensor, turn_ids: torch.Tensor) -> torch.Tensor:
    """Each generated token takes its turn's advantage; other positions 0.

    Args:
        advantages: per turn. Shape: (B, K)
        turn_ids: each position's turn, -1 where no token was generated. Shape: (B, T)

    Returns:
        Shape: (B, T)
    """
    picked = advantages.gather(1, turn_ids.clamp(min=0))
    return torch.where(turn_ids >= 0, picked, torch.zeros_like(picked))
