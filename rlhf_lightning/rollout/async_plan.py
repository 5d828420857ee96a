"""The async settings and the version plan of ``rollout.mode=async``: which policy version and
seed each batch and turn uses, where each rank's producer runs, what the producer needs of the
trainer (:class:`BatchSource`) and the rows it generates for (:class:`RowPlan`).

Versions count optimizer updates of whole batches: the weights after training step ``s`` are
version ``s + 1``, and batch ``s`` trains at version ``s``. With ``rollout.max_staleness=K``:

    batch s is generated with version max(0, s - K)            (every turn)
    rollout.partial=true (partial_versions=newest, the default): turn j of batch s with the
        newest version published when it starts: at least max(0, s - K), at most s
    rollout.partial=true partial_versions=planned: turn j with min(max(0, s - K) + j, s)

so no token is more than K versions old, and the producer works on batch s + K while the
trainer updates on batch s (:mod:`~rlhf_lightning.rollout.async_rollout`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from rlhf_lightning.records.result import RolloutResult
from rlhf_lightning.rollout.async_producer import Placement

Weights = dict[str, torch.Tensor]
PARTIAL_VERSIONS = ("newest", "planned")


class ProducerFailed(RuntimeError):
    """The rollout producer raised, exited or was killed (the run stops with this error)."""


@dataclass(frozen=True)
class AsyncSettings:
    """``rollout.max_staleness``, ``rollout.partial`` and ``rollout.partial_versions``,
    ``rollout.async_timeout_s``, the producer's torch threads, the seed its per-batch seeds
    derive from (with the rank), ``rollout.devices`` (the CUDA device of each rank's producer;
    None: the trainer's device) and the directory the spool goes in (the run directory; None:
    a temporary one)."""

    max_staleness: int
    partial: bool = False
    timeout_s: float = 600.0
    threads: int = 1
    seed: int = 0
    devices: tuple[int, ...] | None = None
    partial_versions: str = "newest"
    spool_dir: str | None = None

    @property
    def newest(self) -> bool:
        """Whether partial turns take the newest version (and K > 0: lockstep has one version)."""
        return self.partial and self.partial_versions == "newest" and self.max_staleness > 0


def placement(devices: tuple[int, ...] | None, rank: int, world_size: int, trainer_device: str) -> Placement:
    """Where ``rank``'s producer runs: ``cuda:<devices[rank]>`` (a device training does not use),
    or, without ``devices``, the trainer's own device (colocated; ``cpu`` on a CPU machine)."""
    if devices is None:
        return Placement(trainer_device, rank, world_size)
    if rank >= len(devices):
        raise ValueError(f"rollout.devices={list(devices)} has no device for rank {rank} of {world_size}")
    return Placement(f"cuda:{devices[rank]}", rank, world_size)


def batch_seed(seed: int, rank: int, step: int) -> int:
    """The producer's seed for batch ``step`` on ``rank`` (distinct per rank and step)."""
    return (seed * 1_000_003 + rank * 7_919 + step * 104_729 + 1) % 2**63


def turn_versions(step: int, staleness: int, partial: bool, max_turns: int) -> list[int]:
    """The policy version of each turn of batch ``step`` (see the module docstring)."""
    first = max(0, step - staleness)
    if not partial:
        return [first]
    return [min(first + j, step) for j in range(max(max_turns, 1))]


def is_stale(result: RolloutResult, step: int) -> bool:
    """Whether any turn of ``result`` was generated with weights older than version ``step``."""
    return any(v < step for t in result.trajectories for v in t.turn_versions)


class RowPlan(Protocol):
    """The rows of each batch of the run, counted from epoch 0, exactly as the train loader yields
    them (:class:`~rlhf_lightning.data.resumable.BatchRows`): handed to the asynchronous rollouts
    at the start of a fit, so they generate for batches the loop has not reached."""

    def rows(self, batch: int) -> list[int]: ...


@dataclass(frozen=True)
class BatchSource:
    """What the producer needs from the trainer: its rank, the current trainable weights
    (``weights()``, a CPU copy), the number of ranks and the trainer's device (where a producer
    without ``rollout.devices`` runs)."""

    rank: int
    weights: Callable[[], Weights]
    world_size: int = 1
    device: str = "cpu"
