"""A rollout source's answer for a batch of rows: the trajectories, their padded batch and the
metrics of the calls that made them (``rollout/*``, ``env/*``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from rlhf_lightning.records.trajectory import Trajectory, TrajectoryBatch


@dataclass
class RolloutResult:
    """Trajectories (as lists, each with its turns' versions and rewards) and their training
    batch; ``metrics`` are the rollout calls' own (floats, averaged over the episodes)."""

    batch: TrajectoryBatch
    trajectories: list[Trajectory]
    metrics: dict[str, float] = field(default_factory=dict)
