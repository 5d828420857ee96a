"""Asynchronous rollouts (``rollout.mode=async``): one driver over transports.

The driver owns everything that decides *what* is generated: which policy version and seed each
batch and turn uses (:mod:`~rlhf_lightning.rollout.asynchronous.plan`: no token more than
``rollout.max_staleness`` versions old), which versions are published and dropped, the pacing
(a request for batch s goes out as soon as its first version is published, so every prompt the
sampler yields is trained on, in order: paced, not filtered), the check that a batch is the one
the trainer is about to train on, the ``async/*`` metrics, and what a checkpoint keeps so a
resume (``resume=true``) regenerates the batches in flight exactly: the K versions before its
step and, for ``newest`` partial turns, the versions their calls started with, which the
regenerated calls use again. ``planned`` makes the whole run reproducible, but a later turn then
waits for weights the trainer has not published yet; ``newest`` never waits.

A :class:`Transport` only moves work and results: it publishes a version where the generation
runs, sends a :class:`~rlhf_lightning.rollout.asynchronous.plan.Request`, and hands back the
:class:`~rlhf_lightning.rollout.asynchronous.plan.Produced` batch (raising when the other side
failed, is gone, or the wait passes ``rollout.async_timeout_s``). Two exist: the producer process
(:class:`~rlhf_lightning.rollout.asynchronous.process.ProcessTransport`: spool files and framed
pipe messages) and the inference servers
(:class:`~rlhf_lightning.rollout.asynchronous.servers.ServerTransport`: HTTP, the episodes on a
trainer thread). A new one is a small class; the driver does not change
(``tests/rollout/test_async_driver.py`` drives a fake one).

``K = 0`` runs the same requests in lockstep (each batch requested when its step starts, without
a seed of its own: the trainer's random generators, handed over and back), so its batches are
the synchronous run's.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from typing import Any, Protocol

import torch

from rlhf_lightning.records.result import RolloutResult
from rlhf_lightning.records.sampling import SamplingParams
from rlhf_lightning.rollout.asynchronous.plan import (
    AsyncSettings,
    BatchSource,
    Produced,
    Request,
    RowPlan,
    batch_seed,
    turn_versions,
)

log = logging.getLogger(__name__)
Metrics = dict[str, torch.Tensor]


class CallLog:
    """The version each generate call of the batches in flight started with, by batch (a
    checkpoint keeps them for ``newest`` partial turns). Written by whichever thread or message
    reader hears of a call; read by the trainer."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: dict[int, list[int]] = {}

    def started(self, step: int, call: int, version: int) -> None:
        with self._lock:
            calls = self._calls.setdefault(step, [])
            if len(calls) != call:
                raise RuntimeError(f"batch {step}: call {call} started after {len(calls)} calls")
            calls.append(version)

    def forget(self, step: int) -> None:
        with self._lock:
            self._calls.pop(step, None)

    def of(self, steps: list[int]) -> dict[int, list[int]]:
        """The calls started so far of each of ``steps`` that has any."""
        with self._lock:
            return {s: list(self._calls[s]) for s in steps if self._calls.get(s)}

    def clear(self) -> None:
        with self._lock:
            self._calls.clear()


class Transport(Protocol):
    """How a batch's work reaches the place that generates it and comes back.

    ``kind`` names what :meth:`saved` returns (a checkpoint of another transport's kind has its
    versions published anew from the current weights instead)."""

    kind: str

    def start(self, source: BatchSource, calls: CallLog) -> None:
        """Start the other side (a process, the servers) for ``source``'s rank; it reports each
        generate call's version to ``calls``."""
        ...

    def publish(self, version: int, source: BatchSource) -> None:
        """Make ``source``'s current weights available as ``version``."""
        ...

    def restore(self, version: int, saved: Any) -> None:
        """Make a checkpoint's ``version`` (as :meth:`saved` returned it) available."""
        ...

    def saved(self, version: int) -> Any | None:
        """``version`` as a checkpoint keeps it, or None when it is not held."""
        ...

    def drop_before(self, version: int) -> None:
        """No request or checkpoint needs versions older than ``version`` any more."""
        ...

    def poll(self) -> None:
        """Book what the other side has reported so far (its calls' versions), without waiting."""
        ...

    def submit(self, req: Request) -> None:
        """Send ``req`` (its first version is published)."""
        ...

    def receive(self, step: int, timeout_s: float) -> Produced:
        """Batch ``step``: raises the other side's error, or after ``timeout_s`` without it."""
        ...

    def close(self) -> None:
        """Stop the other side; anything in flight is dropped."""
        ...


class AsyncDriver:
    """Keeps the transport ``rollout.max_staleness`` batches ahead of the trainer (module docstring).

    Args:
        transport: where the batches are generated (:class:`Transport`).
        settings: see :class:`~rlhf_lightning.rollout.asynchronous.plan.AsyncSettings`.
        max_turns: the env's turns per episode (partial rollouts' version plan).
    """

    def __init__(self, transport: Transport, settings: AsyncSettings, max_turns: int) -> None:
        self.transport, self.s, self.max_turns = transport, settings, max_turns
        self.calls = CallLog()
        self.held: set[int] = set()  # versions published on the transport
        self.restored: dict[int, Any] = {}  # versions from a checkpoint (or a closed transport's)
        self.replay: dict[int, list[int]] = {}  # step -> its calls' versions before a resume
        self.requested: dict[int, list[int]] = {}  # step -> rows, for batches not taken yet
        self.started = False
        self.rank = 0
        self.plan: RowPlan | None = None  # the rows of each batch, handed over by begin()
        self.sampling, self.group_size = SamplingParams(), 1

    # ---------------------------------------------------------------- one training step
    def begin(
        self, step: int, plan: RowPlan, sampling: SamplingParams, group_size: int, source: BatchSource
    ) -> None:
        """At the start of a fit, before batch ``step``: start the transport, publish the
        checkpoint's versions and the current one (``step``), and (K > 0) request the batches
        ``step .. step + K``, each for the rows ``plan`` gives it."""
        if self.started:
            return
        self.plan, self.sampling, self.group_size = plan, replace(sampling), group_size
        self.rank = source.rank
        self.transport.start(source, self.calls)
        self.started = True
        for v, saved in sorted(self.restored.items()):
            self.transport.restore(v, saved)
            self.held.add(v)
        self.restored.clear()
        k = self.s.max_staleness
        missing = [v for v in range(max(0, step - k), step) if v not in self.held]
        if missing:  # e.g. a synchronous run's checkpoint resumed with rollout.mode=async
            log.warning(
                "asynchronous rollouts: versions %s are not in the checkpoint; using version %d",
                missing,
                step,
            )
        for v in [*missing, step]:
            self.publish(v, source)
        if k > 0:
            for b in range(step, step + k + 1):
                self.request(b, plan.rows(b))

    def rollout(self, step: int, rows: list[int]) -> tuple[RolloutResult, Metrics]:
        """Batch ``step``, which the trainer trains on ``rows`` (in lockstep, K = 0, requested
        now), and its ``async/*`` metrics: token staleness, the trainer's and the producer's waits."""
        if not self.started or self.plan is None:
            raise RuntimeError("asynchronous rollouts: batch requested before begin() (the fit's start)")
        t0 = time.perf_counter()
        if self.s.max_staleness == 0:
            self.request(step, rows)
        produced = self.take(step, rows)
        return produced.result, batch_metrics(produced, step, time.perf_counter() - t0)

    def updated(self, version: int, source: BatchSource) -> None:
        """The trainer finished update ``version - 1``: publish its weights, drop the versions no
        batch may use any more, and (K > 0) request the batch generated with it (``version + K``)."""
        if not self.started or self.plan is None:
            return
        self.publish(version, source)
        if self.s.max_staleness > 0:
            b = version + self.s.max_staleness
            self.request(b, self.plan.rows(b))

    def publish(self, version: int, source: BatchSource) -> None:
        k = self.s.max_staleness
        self.transport.publish(version, source)
        self.held.add(version)
        self.transport.drop_before(version - k)
        self.held = {v for v in self.held if v >= version - k}

    # ---------------------------------------------------------------- requests and batches
    def make_request(self, step: int, rows: list[int]) -> Request:
        """Batch ``step``'s versions, seed (None in lockstep: the trainer's generators) and replay."""
        k = self.s.max_staleness
        return Request(
            step,
            list(rows),
            turn_versions(step, k, self.s.partial and not self.s.newest, self.max_turns),
            self.group_size,
            replace(self.sampling),
            seed=None if k == 0 else batch_seed(self.s.seed, self.rank, step),
            newest=self.s.newest,
            replay=self.replay.pop(step, []),
        )

    def request(self, step: int, rows: list[int]) -> None:
        """Ask for batch ``step`` (its first version must be published)."""
        self.requested[step] = list(rows)
        self.transport.submit(self.make_request(step, rows))

    def take(self, step: int, rows: list[int]) -> Produced:
        """Batch ``step``, which the trainer is about to train on ``rows`` (checked against the
        rows it was requested for)."""
        if step not in self.requested:
            raise RuntimeError(f"batch {step} was not requested (AsyncDriver.take called out of order)")
        produced = self.transport.receive(step, self.s.timeout_s)
        wanted = self.requested.pop(step)
        self.calls.forget(step)
        if produced.step != step or wanted != list(rows):
            raise RuntimeError(
                f"asynchronous rollouts: the batch is for step {produced.step} with rows {wanted}, the "
                f"trainer is at step {step} with rows {list(rows)}: the train loader's order changed "
                "(rollout.mode=async needs the default prompt sampler and whole epochs)"
            )
        return produced

    # ---------------------------------------------------------------- checkpoints and the end
    def state_dict(self, batches_done: int) -> dict[str, Any]:
        """What a resume needs to regenerate the batches in flight: the versions before
        ``batches_done`` that they use (the current weights are in the checkpoint anyway) and,
        for ``newest`` partial turns, the versions their calls have started with so far."""
        keep = range(max(0, batches_done - self.s.max_staleness), batches_done)
        versions = {v: saved for v in keep if (saved := self.saved(v)) is not None}
        self.transport.poll()
        turns = self.calls.of(sorted(self.requested))
        return {"kind": self.transport.kind, "versions": versions, "turns": turns}

    def saved(self, version: int) -> Any | None:
        if version in self.held:
            return self.transport.saved(version)
        return self.restored.get(version)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # A checkpoint from before the transports had kinds is the producer process's.
        if state.get("kind", "producer") == self.transport.kind:
            self.restored.update({int(v): saved for v, saved in state.get("versions", {}).items()})
        self.replay = {int(step): [int(v) for v in vs] for step, vs in state.get("turns", {}).items()}

    def close(self) -> None:
        """Stop the transport (at the end of a fit, or when it failed); the versions a later
        fit needs stay in memory."""
        if self.started:
            self.restored.update(
                {v: saved for v in self.held if (saved := self.transport.saved(v)) is not None}
            )
        self.transport.close()
        self.held.clear()
        self.requested.clear()
        self.calls.clear()
        self.started = False


def batch_metrics(produced: Produced, step: int, waited: float) -> Metrics:
    """Staleness of the batch's generated tokens (versions behind ``step``; a trajectory without
    versions, e.g. a dynamic-sampling refill made now, is current) and the waits."""
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
