"""The records one training step hands from stage to stage: what a family's ``advantages`` found
(advantages, and a critic's targets) and what scoring decided (advantages, the loss mask, the
metrics). Every stage takes them as arguments; no stage leaves state on the module or the
objective for a later one to read.

Notation:
    B: trajectories in the rollout batch, T: token positions (L-1), S: steps (turns or tokens).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from rlhf_lightning.records.trajectory import TrajectoryBatch

Metrics = dict[str, torch.Tensor]


@dataclass(frozen=True)
class CriticTargets:
    """What a critic trains on for one rollout batch (PPO's value loss).

    Shapes:
        steps_idx: each action token's step, -1 elsewhere. (B, T)
        old_values: the critic's step values before the update. (B, S)
        returns: the GAE value targets. (B, S)
        step_mask: which steps exist. (B, S)
    """

    steps_idx: torch.Tensor
    old_values: torch.Tensor
    returns: torch.Tensor
    step_mask: torch.Tensor

    def rows(self, index: torch.Tensor, width: int) -> CriticTargets:
        """The targets of rows ``index``, token columns trimmed to ``width``. Shapes: (b, ...)"""
        return CriticTargets(
            self.steps_idx[index][:, :width],
            self.old_values[index],
            self.returns[index],
            self.step_mask[index],
        )


@dataclass(frozen=True)
class Advantages:
    """What a family's ``advantages`` returns.

    Args:
        tokens: per trajectory (B,) or per token (B, T).
        critic: a critic family's value targets, else None.
        level: the steps the advantages were computed over (``turn`` | ``token``), where the
            family's objective depends on it (PPO's ratio level), else None.
        metrics: diagnostics of the computation (logged with the rollout's).
    """

    tokens: torch.Tensor
    critic: CriticTargets | None = None
    level: str | None = None
    metrics: Metrics = field(default_factory=dict)


@dataclass(frozen=True)
class Scored:
    """One rollout batch, scored: what the update trains on.

    Args:
        adv: shaped advantages, per trajectory (B,) or per token (B, T).
        mask: the action tokens that count in the loss. (B, T)
        metrics: scoring metrics (detached, on the CPU).
        critic, level: as in :class:`Advantages`.
        old_logp: the behaviour log-probs the ratios use (B, T), None when the update is
            on-policy (its own, detached).
        ref_logp: the reference's log-probs (B, T), None without a KL.
    """

    adv: torch.Tensor
    mask: torch.Tensor
    metrics: Metrics
    critic: CriticTargets | None = None
    level: str | None = None
    old_logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None


@dataclass(frozen=True)
class StepSummary:
    """What one training step did, global over ranks (the logged values), for the callbacks
    that act on it (the guard, the population): the one place that reads metric names for them.
    A field is None when the step did not log it (e.g. no actor update in PPO's critic warm-up).
    """

    reward_mean: float | None = None  # rollout/reward_mean
    reward_std: float | None = None  # rollout/reward_std
    empty_frac: float | None = None  # rollout/empty_frac: completions of at most one token
    grad_norm: float | None = None  # actor/grad_norm, before clipping
    loss: float | None = None  # actor/loss
    lr: float | None = None  # actor/lr

    @classmethod
    def from_metrics(cls, values: Mapping[str, float]) -> StepSummary:
        return cls(
            reward_mean=values.get("rollout/reward_mean"),
            reward_std=values.get("rollout/reward_std"),
            empty_frac=values.get("rollout/empty_frac"),
            grad_norm=values.get("actor/grad_norm"),
            loss=values.get("actor/loss"),
            lr=values.get("actor/lr"),
        )


@dataclass(frozen=True)
class UpdateInputs:
    """What every mini-batch of one update reads: the batch, its scores, its behaviour and
    reference log-probs (B, T) or None, the objective, and every row's length (token-budget
    micro-batches; empty otherwise)."""

    traj: TrajectoryBatch
    scored: Scored
    old_logp: torch.Tensor | None
    ref_logp: torch.Tensor | None
    objective: Any
    lengths: list[int]
