"""Asynchronous rollouts on inference servers (``rollout.mode=async rollout=vllm_server``).

The same plan as the producer process's (:mod:`~rlhf_lightning.rollout.async_plan`): batch s is
generated with version ``max(0, s - K)`` (partial rollouts: later turns newer, ``newest`` or
``planned``), requested as soon as that version is published, so the staleness bound holds on
every token and every prompt the sampler yields is trained on, in order; each batch has its own
seed (each generate call its own, from the batch's), so a resumed run regenerates the batches in
flight exactly; the ratio's behaviour log-probs are the servers' (the generating version's).

What differs is where the work runs: generation on the servers, the episodes (env steps, chat
formatting) on one thread of the trainer, which keeps ``K`` batches ahead while the trainer
updates. No copy of the model, no pickled batches: versions are published straight from the
trainer's policy as directories the servers load (:class:`~rlhf_lightning.rollout.vllm_server.
VLLMServerEngine`), several held at once with LoRA. ``K = 0`` runs each batch in the trainer's
own thread when its step starts, drawing its seeds from the trainer's generator as a synchronous
run does, so its batches are the synchronous run's.

Faults: every request has a timeout and retries (a server that is gone fails at once), the
trainer waits for a batch at most ``rollout.async_timeout_s``, and the thread's error (the
server's, named with its URL and log) ends the run; the periodic checkpoints resume it. A
checkpoint holds the files of the versions the batches in flight use.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from rlhf_lightning.records.result import RolloutResult
from rlhf_lightning.records.sampling import SamplingParams
from rlhf_lightning.rollout.async_plan import (
    AsyncSettings,
    BatchSource,
    ProducerFailed,
    RowPlan,
    batch_seed,
    turn_versions,
)
from rlhf_lightning.rollout.async_producer import POLL_S, Produced, Request, Stop, VersionedSampler, planned
from rlhf_lightning.rollout.async_rollout import AsyncRollouts
from rlhf_lightning.rollout.harness import RolloutHarness
from rlhf_lightning.rollout.vllm_server import VLLMServerEngine

log = logging.getLogger(__name__)
KIND = "vllm_server"  # a checkpoint's versions are these runs' files (the producer's are tensors)


class ServerRolloutsFailed(ProducerFailed):
    """The rollout thread failed (a server gone, a request refused, an env error)."""


class ServerRollouts:
    """The trainer's asynchronous rollouts with generation on the servers (module docstring).

    Args:
        engine: the servers (not started yet; started by :meth:`begin`).
        harness: the episodes' driver (the thread's own, not the trainer's evaluation harness).
        policy: the trainer's policy, whose weights each published version is.
        settings: ``rollout.max_staleness``, ``partial``, ``partial_versions``, ``async_timeout_s``
            and the seed (see :class:`~rlhf_lightning.rollout.async_plan.AsyncSettings`).
        max_turns: the env's turns per episode (partial rollouts' version plan).
    """

    def __init__(
        self,
        engine: VLLMServerEngine,
        harness: RolloutHarness,
        policy: Any,
        settings: AsyncSettings,
        max_turns: int,
    ) -> None:
        self.engine, self.harness, self.policy, self.s, self.max_turns = (
            engine,
            harness,
            policy,
            settings,
            max_turns,
        )
        self.restored: dict[int, dict[str, bytes]] = {}  # versions' files from a checkpoint
        self.replay: dict[int, list[int]] = {}  # step -> its calls' versions before a resume
        self.published: set[int] = set()
        self.requested: dict[int, list[int]] = {}  # step -> rows, for batches not taken yet
        self.pending: deque[Request] = deque()
        self.done: dict[int, Produced] = {}
        self.turns: dict[int, list[int]] = {}  # step -> the versions its calls started with
        self.failure: BaseException | None = None
        self.thread: threading.Thread | None = None
        self.started = self.stopping = False
        self.idle_s = 0.0  # the thread's waits for requests and versions since its last batch
        self.rank = 0
        self.plan: RowPlan | None = None  # the rows of each batch, handed over by begin()
        self.sampling, self.group_size = SamplingParams(), 1
        self.cond = threading.Condition()

    # ---------------------------------------------------------------- one training step
    def begin(
        self, step: int, plan: RowPlan, sampling: SamplingParams, group_size: int, source: BatchSource
    ) -> None:
        """At the start of a fit, before batch ``step``: start the servers, publish the
        checkpoint's versions and the current one (``step``), then (K > 0) start the thread and
        request the batches ``step .. step + K``, each for the rows ``plan`` gives it."""
        if self.started:
            return
        self.plan, self.sampling, self.group_size = plan, replace(sampling), group_size
        self.rank = source.rank
        self.engine.bind_rank(source.rank, source.world_size, 0)
        self.engine.start()
        for v, files in sorted(self.restored.items()):
            self.engine.publish_files(v, files)
            self.published.add(v)
        self.restored.clear()
        missing = [v for v in range(max(0, step - self.s.max_staleness), step) if v not in self.published]
        if missing:  # e.g. a synchronous run's checkpoint resumed with rollout.mode=async
            log.warning(
                "asynchronous rollouts: versions %s are not in the checkpoint; using version %d",
                missing,
                step,
            )
        for v in [*missing, step]:
            self.engine.publish(v, self.policy)
            self.published.add(v)
        self.started = True
        if self.s.max_staleness > 0:
            self.thread = threading.Thread(target=self.work, name="server-rollouts", daemon=True)
            self.thread.start()
            for b in range(step, step + self.s.max_staleness + 1):
                self.request(b, plan.rows(b), sampling, group_size)

    def rollout(self, step: int, rows: list[int]) -> tuple[RolloutResult, dict[str, torch.Tensor]]:
        """Batch ``step``, which the trainer trains on ``rows``, and its ``async/*`` metrics."""
        if not self.started or self.plan is None:
            raise RuntimeError("asynchronous rollouts: batch requested before begin() (the fit's start)")
        t0 = time.perf_counter()
        if self.s.max_staleness == 0:  # lockstep: here, now, with the trainer's generator
            produced = self.produce(self.make_request(step, rows, self.sampling, self.group_size))
        else:
            produced = self.take(step, rows)
        return produced.result, AsyncRollouts.metrics(produced, step, time.perf_counter() - t0)

    def updated(self, version: int, source: BatchSource) -> None:
        """The trainer finished update ``version - 1``: publish its weights, drop the versions no
        batch may use any more, and (K > 0) request the batch generated with it (``version + K``)."""
        if not self.started or self.plan is None:
            return
        self.engine.publish(version, self.policy)
        with self.cond:
            self.published.add(version)
            self.cond.notify_all()
        self.engine.drop_before(version - self.s.max_staleness)
        with self.cond:
            self.published = {v for v in self.published if v >= version - self.s.max_staleness}
        if self.s.max_staleness > 0:
            b = version + self.s.max_staleness
            self.request(b, self.plan.rows(b), self.sampling, self.group_size)

    # ---------------------------------------------------------------- requests and batches
    def make_request(self, step: int, rows: list[int], sampling: SamplingParams, group_size: int) -> Request:
        """Batch ``step``'s versions, seed (None in lockstep: the trainer's generator) and replay."""
        k = self.s.max_staleness
        return Request(
            step,
            list(rows),
            turn_versions(step, k, self.s.partial and not self.s.newest, self.max_turns),
            group_size,
            replace(sampling),
            seed=None if k == 0 else batch_seed(self.s.seed, self.rank, step),
            newest=self.s.newest,
            replay=self.replay.pop(step, []),
        )

    def request(self, step: int, rows: list[int], sampling: SamplingParams, group_size: int) -> None:
        req = self.make_request(step, rows, sampling, group_size)
        with self.cond:
            self.pending.append(req)
            self.requested[step] = list(rows)
            self.cond.notify_all()

    def take(self, step: int, rows: list[int]) -> Produced:
        """Batch ``step``, which the trainer is about to train on ``rows``; raises the thread's
        error, or after ``rollout.async_timeout_s``."""
        deadline = time.monotonic() + self.s.timeout_s
        with self.cond:
            while step not in self.done:
                if self.failure is not None:
                    raise ServerRolloutsFailed(
                        f"asynchronous rollouts on the servers failed: {self.failure}"
                    ) from self.failure
                if self.thread is None or not self.thread.is_alive():
                    raise ServerRolloutsFailed(
                        f"the rollout thread is gone while the trainer waited for step {step}"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"waited {self.s.timeout_s:.0f} s for the rollout batch of step {step} "
                        "(rollout.async_timeout_s); the servers answer too slowly"
                    )
                self.cond.wait(min(left, POLL_S))
            produced = self.done.pop(step)
            wanted = self.requested.pop(step, None)
            self.turns.pop(step, None)
        if wanted != list(rows):
            raise RuntimeError(
                f"asynchronous rollouts: batch {step} was requested for rows {wanted}, the trainer trains "
                f"on {list(rows)}: the train loader's order changed (rollout.mode=async needs the default "
                "prompt sampler and whole epochs)"
            )
        return produced

    # ---------------------------------------------------------------- the thread
    def work(self) -> None:
        """Produce the requested batches in order until stopped; an error is kept for ``take``."""
        try:
            while True:
                req = self.next_request()
                produced = self.produce(req)
                with self.cond:
                    self.done[req.step] = produced
                    self.cond.notify_all()
        except Stop:
            return
        except BaseException as err:  # handed to the trainer's thread
            with self.cond:
                self.failure = err
                self.cond.notify_all()

    def next_request(self) -> Request:
        with self.cond:
            t0 = time.perf_counter()
            while not self.pending:
                if self.stopping:
                    raise Stop
                self.cond.wait(POLL_S)
            self.idle_s += time.perf_counter() - t0
            return self.pending.popleft()

    def produce(self, req: Request) -> Produced:
        """Run ``req``'s episodes, each generate call on its version (loaded on the servers first)."""
        t0, idle_before = time.perf_counter(), self.idle_s
        sampler = VersionedSampler(
            self.engine, self.load, self.chooser(req), req.seed, self.announcer(req.step)
        )
        result = self.harness.rollout(sampler, req.rows, req.sampling, group_size=req.group_size)
        for traj in result.trajectories:
            traj.turn_versions = sampler.used[: traj.num_turns]
        work = time.perf_counter() - t0 - (self.idle_s - idle_before)
        produced = Produced(req.step, result, sampler.used, self.idle_s, work, None, req.seed)
        self.idle_s = 0.0
        return produced

    def load(self, version: int) -> None:
        """Sample ``version`` from now on, once the trainer has published it."""
        with self.cond:
            t0 = time.perf_counter()
            while version not in self.published:
                if self.stopping:
                    raise Stop
                self.cond.wait(POLL_S)
            self.idle_s += time.perf_counter() - t0
        self.engine.use(version)

    def chooser(self, req: Request) -> Callable[[int], int]:
        """Call ``i``'s version: a replayed one, the newest published (``newest``), or the plan's."""
        plan = planned(req.versions)

        def choose(call: int) -> int:
            if call < len(req.replay):
                return req.replay[call]
            if req.newest:
                with self.cond:
                    return max(
                        [v for v in self.published if req.versions[0] <= v <= req.step],
                        default=req.versions[0],
                    )
            return plan(call)

        return choose

    def announcer(self, step: int) -> Callable[[int, int], None]:
        """Record the version each call of batch ``step`` starts with (a checkpoint keeps them)."""

        def started(call: int, version: int) -> None:
            with self.cond:
                self.turns.setdefault(step, []).append(version)

        return started

    # ---------------------------------------------------------------- checkpoints and the end
    def state_dict(self, batches_done: int) -> dict[str, Any]:
        """The files of the versions before ``batches_done`` that batches in flight use, and the
        versions the calls of ``newest`` partial batches started with so far."""
        keep = range(max(0, batches_done - self.s.max_staleness), batches_done)
        versions = {v: f for v in keep if (f := self.version_files(v)) is not None}
        with self.cond:
            turns = {step: list(self.turns[step]) for step in self.requested if self.turns.get(step)}
        return {"kind": KIND, "versions": versions, "turns": turns}

    def version_files(self, version: int) -> dict[str, bytes] | None:
        return self.engine.files_of(version) if version in self.published else self.restored.get(version)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") == KIND:  # a producer's versions (tensors) are published anew instead
            self.restored.update({int(v): dict(f) for v, f in state.get("versions", {}).items()})
        self.replay = {int(step): [int(v) for v in vs] for step, vs in state.get("turns", {}).items()}

    def close(self) -> None:
        """Stop the thread, the engine (its servers, if it started them) and the harness's
        workers; the versions a later fit needs stay in memory."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        if self.started:
            self.restored.update({v: f for v in self.published if (f := self.engine.files_of(v)) is not None})
        self.engine.shutdown()  # first: a request in flight then fails at once
        if self.thread is not None:
            self.thread.join(timeout=10.0)  # (a daemon: one still in a call cannot hold the process)
        self.harness.close()  # its env-step workers
        self.published.clear()
        self.requested.clear()
        self.pending.clear()
        self.done.clear()
        self.turns.clear()
        self.thread, self.failure, self.started, self.stopping = None, None, False, False
