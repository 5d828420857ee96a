"""Asynchronous rollouts (``rollout.mode=async``): the trainer's side of the producer process.

Versions count optimizer updates of whole batches: the weights after training step ``s`` are
version ``s + 1``, and batch ``s`` trains at version ``s``. With ``rollout.max_staleness=K``:

    batch s is generated with version max(0, s - K)            (every turn)
    rollout.partial=true: turn j of batch s with min(max(0, s - K) + j, s)

so no token is more than K versions old, and the producer works on batch s + K while the
trainer updates on batch s. It is *paced*, not filtered: a request for batch s goes out as soon
as its first version is published, and the producer waits for a version it does not have yet
(a partial rollout's later turns), so every prompt the sampler yields is trained on, in order.
Which version and which seed a batch uses is fixed in advance, never by timing, so a run is
reproducible and a resume (``resume=true``) regenerates the batches in flight: the checkpoint
keeps the K versions before its step (:meth:`AsyncRollouts.state_dict`).

``K = 0`` runs the same requests in lockstep (each batch requested when its step starts, with
the trainer's RNG states handed over and back), so its batches are the synchronous run's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.multiprocessing as mp

from rlhf_lightning.algorithms.async_producer import (
    POLL_S,
    Placement,
    Produced,
    Request,
    pack,
    producer_main,
    unpack,
)
from rlhf_lightning.envs.harness import RolloutResult
from rlhf_lightning.rollout.engine import SamplingParams
from rlhf_lightning.runtime import rng

log = logging.getLogger(__name__)

Weights = dict[str, torch.Tensor]


@dataclass(frozen=True)
class AsyncSettings:
    """``rollout.max_staleness``, ``rollout.partial``, ``rollout.async_timeout_s``, the producer's
    torch threads, the seed its per-batch seeds derive from (with the rank) and
    ``rollout.devices`` (the CUDA device of each rank's producer; None: the trainer's device)."""

    max_staleness: int
    partial: bool = False
    timeout_s: float = 600.0
    threads: int = 1
    seed: int = 0
    devices: tuple[int, ...] | None = None


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


class AsyncRollouts:
    """Runs the producer process and keeps it ``max_staleness`` batches ahead of the trainer.

    Args:
        build: builds the producer's (harness, engine, policy) on a :class:`Placement`, in its
            process (picklable).
        settings: see :class:`AsyncSettings`.
        max_turns: the env's turns per episode (partial rollouts' version plan).
    """

    def __init__(
        self, build: Callable[[Placement], tuple[Any, Any, Any]], settings: AsyncSettings, max_turns: int
    ) -> None:
        self.build, self.s, self.max_turns = build, settings, max_turns
        self.store: dict[int, Weights] = {}  # published versions a request or a checkpoint may need
        self.sent: set[int] = set()  # versions the producer has
        self.requested: dict[int, list[int]] = {}  # step -> rows, for requests in flight
        self.rank = 0
        self.place = Placement()
        self.proc: Any = None

    # ---------------------------------------------------------------- process
    def start(self) -> None:
        """Start the producer process and wait until it has built its parts."""
        ctx = mp.get_context("spawn")
        self.commands, self.results = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(
            target=producer_main,
            args=(self.build, self.commands, self.results, self.s.threads, os.getpid(), self.place),
            name="rollout-producer",
            daemon=True,
        )
        self.proc.start()
        self.receive("ready", "the rollout producer to start (build its model, env and engine)")

    def receive(self, kind: str, what: str) -> Any:
        """The next message of ``kind``; raises with the producer's traceback if it failed, and
        with ``what`` if it exits or ``rollout.async_timeout_s`` passes first."""
        deadline = time.monotonic() + self.s.timeout_s
        while True:
            try:
                message = self.results.get(timeout=POLL_S)
            except queue.Empty:
                if not self.proc.is_alive():
                    raise RuntimeError(
                        f"the rollout producer (pid {self.proc.pid}) exited with code {self.proc.exitcode} "
                        f"while the trainer waited for {what} (its error, if any, is on stderr above; a script "
                        "that starts a run needs an `if __name__ == '__main__':` guard: the producer is spawned)"
                    ) from None
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"waited {self.s.timeout_s:.0f} s for {what} (rollout.async_timeout_s); the producer "
                        f"(pid {self.proc.pid}) is alive but sent nothing"
                    ) from None
                continue
            if message[0] == "error":
                raise RuntimeError(f"the rollout producer failed:\n{message[1]}")
            if message[0] != kind:
                raise RuntimeError(
                    f"the rollout producer sent {message[0]!r} while the trainer waited for {what}"
                )
            return message[1]

    def close(self) -> None:
        """Stop the producer (at the end of a fit, or when it failed)."""
        if self.proc is None:
            return
        if self.proc.is_alive():
            self.commands.put(("stop",))
            # Batches requested ahead that no step will train on: read and drop them, or the
            # producer blocks at its exit flushing them into a full pipe.
            deadline = time.monotonic() + 10
            while self.proc.is_alive() and time.monotonic() < deadline:
                with contextlib.suppress(queue.Empty):
                    self.results.get(timeout=POLL_S)  # bytes: dropped unread
            if self.proc.is_alive():
                self.proc.terminate()
            self.proc.join(timeout=5)
        self.proc = None
        self.sent.clear()  # a producer started again (a second fit) gets every version anew
        self.requested.clear()

    # ---------------------------------------------------------------- versions and requests
    def publish(self, version: int, weights: Weights) -> None:
        """Version ``version`` of the trainable weights (after that many updates); older versions
        no request or checkpoint needs any more are dropped."""
        self.store[version] = weights
        for old in [v for v in self.store if v < version - self.s.max_staleness]:
            del self.store[old]
        if self.proc is not None:
            self.send_weights(version)

    def send_weights(self, version: int) -> None:
        if version not in self.sent and version in self.store:
            self.commands.put(("weights", version, pack(self.store[version])))
            self.sent.add(version)

    def request(self, step: int, rows: list[int], sampling: SamplingParams, group_size: int) -> None:
        """Ask for batch ``step`` (its first version must be published)."""
        versions = turn_versions(step, self.s.max_staleness, self.s.partial, self.max_turns)
        for v in sorted(set(versions)):
            self.send_weights(v)  # the later versions of a partial rollout follow as they are published
        lockstep = self.s.max_staleness == 0
        req = Request(
            step,
            list(rows),
            versions,
            group_size,
            replace(sampling),
            seed=None if lockstep else batch_seed(self.s.seed, self.rank, step),
            rng_state=rng.capture() if lockstep else None,
        )
        self.commands.put(("generate", pack(req)))
        self.requested[step] = list(rows)

    def take(self, step: int, rows: list[int]) -> Produced:
        """Batch ``step``, which the trainer is about to train on ``rows`` (checked against the
        rows it was requested for); in lockstep (K = 0) requested now."""
        if self.s.max_staleness == 0 and step not in self.requested:
            raise RuntimeError(f"batch {step} was not requested (AsyncRollouts.take called out of order)")
        produced: Produced = unpack(self.receive("batch", f"the rollout batch of step {step}"))
        wanted = self.requested.pop(produced.step, None)
        if produced.step != step or wanted != list(rows):
            raise RuntimeError(
                f"asynchronous rollouts: the producer's batch is for step {produced.step} with rows {wanted}, "
                f"the trainer is at step {step} with rows {list(rows)}: the train loader's order changed "
                "(rollout.mode=async needs the default prompt sampler and whole epochs)"
            )
        if produced.rng_state is not None:
            rng.restore(produced.rng_state)  # lockstep: the trainer continues after the sampling draws
        return produced

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self, batches_done: int) -> dict[str, Any]:
        """What a resume needs to regenerate the batches in flight: the versions before
        ``batches_done`` that they use (the current weights are in the checkpoint anyway)."""
        keep = range(max(0, batches_done - self.s.max_staleness), batches_done)
        return {"versions": {v: self.store[v] for v in keep if v in self.store}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.store.update({int(v): w for v, w in state.get("versions", {}).items()})

    # ---------------------------------------------------------------- one training step
    def rollout(
        self,
        step: int,
        rows: list[int],
        sampling: SamplingParams,
        group_size: int,
        source: BatchSource,
    ) -> tuple[RolloutResult, dict[str, torch.Tensor]]:
        """Batch ``step`` for ``rows`` (starting the producer at the first step of a fit), and
        its ``async/*`` metrics: token staleness, the trainer's and the producer's waits."""
        if self.proc is None:
            self.begin(step, rows, sampling, group_size, source)
        if self.s.max_staleness == 0:
            self.request(step, rows, sampling, group_size)
        t0 = time.perf_counter()
        produced = self.take(step, rows)
        waited = time.perf_counter() - t0
        return produced.result, self.metrics(produced, step, waited)

    def begin(
        self, step: int, rows: list[int], sampling: SamplingParams, group_size: int, source: BatchSource
    ) -> None:
        """Publish the current weights as version ``step``, start the producer, and request the
        batches ``step .. step + K`` (their versions are this one or the checkpoint's)."""
        self.rank = source.rank
        self.place = placement(self.s.devices, source.rank, source.world_size, source.device)
        current = source.weights()
        missing = [v for v in range(max(0, step - self.s.max_staleness), step) if v not in self.store]
        if missing:  # e.g. a synchronous run's checkpoint resumed with rollout.mode=async
            log.warning(
                "asynchronous rollouts: versions %s are not in the checkpoint; using version %d",
                missing,
                step,
            )
            self.store.update({v: current for v in missing})
        self.publish(step, current)
        self.start()
        for v in sorted(self.store):
            self.send_weights(v)
        if self.s.max_staleness > 0:
            for b in range(step, step + self.s.max_staleness + 1):
                self.request(b, rows if b == step else source.rows_of(b), sampling, group_size)

    def updated(self, version: int, sampling: SamplingParams, group_size: int, source: BatchSource) -> None:
        """The trainer finished update ``version - 1``: publish its weights and request the batch
        that is generated with them (``version + K``)."""
        if self.proc is None:
            return
        self.publish(version, source.weights())
        if self.s.max_staleness > 0:
            b = version + self.s.max_staleness
            self.request(b, source.rows_of(b), sampling, group_size)

    @staticmethod
    def metrics(produced: Produced, step: int, waited: float) -> dict[str, torch.Tensor]:
        """Staleness of the batch's generated tokens (versions behind ``step``; a trajectory
        without versions, e.g. a dynamic-sampling refill made now, is current) and the waits."""
        ages = [
            step - v
            for t in produced.result.trajectories
            for v, n in zip(t.turn_versions or [step] * t.num_turns, t.turn_lengths)
            for _ in range(n)
        ] or [0]
        age = torch.tensor(ages, dtype=torch.float32)
        return {
            "async/staleness_mean": age.mean(),
            "async/staleness_max": age.max(),
            "async/trainer_wait_s": torch.tensor(waited),
            "async/producer_wait_s": torch.tensor(produced.wait_s),
            "async/producer_work_s": torch.tensor(produced.work_s),
        }


def is_stale(result: RolloutResult, step: int) -> bool:
    """Whether any turn of ``result`` was generated with weights older than version ``step``."""
    return any(v < step for t in result.trajectories for v in t.turn_versions)


@dataclass(frozen=True)
class BatchSource:
    """What the producer needs from the trainer: its rank, the current trainable weights
    (``weights()``, a CPU copy), the rows of a future batch (``rows_of(step)``), the number of
    ranks and the trainer's device (where a producer without ``rollout.devices`` runs)."""

    rank: int
    weights: Callable[[], Weights]
    rows_of: Callable[[int], list[int]]
    world_size: int = 1
    device: str = "cpu"
