"""The inference-server transport of asynchronous rollouts (``rollout.mode=async
rollout=vllm_server``).

Generation runs on the servers, the episodes (env steps, chat formatting) on one thread of the
trainer, which works through the driver's requests in order while the trainer updates. No copy
of the model, no pickled batches: versions are published straight from the trainer's policy as
directories the servers load (:class:`~rlhf_lightning.rollout.servers.engine.VLLMServerEngine`),
several held at once with LoRA, and a checkpoint keeps their files. Each batch has its own seed
(each generate call its own, from the batch's); the ratio's behaviour log-probs are the
servers' (the generating version's). In lockstep (``K = 0``) a request runs at once in the
trainer's own thread, drawing from the trainer's generators as a synchronous run does.

Faults: every HTTP request has a timeout and retries (a server that is gone fails at once), the
trainer waits for a batch at most ``rollout.async_timeout_s``, and the thread's error (the
server's, named with its URL and log) ends the run; the periodic checkpoints resume it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

from rlhf_lightning.rollout.asynchronous.driver import CallLog
from rlhf_lightning.rollout.asynchronous.plan import (
    POLL_S,
    BatchSource,
    Produced,
    ProducerFailed,
    Request,
    Stop,
    VersionedSampler,
    chooser,
    run_request,
)
from rlhf_lightning.rollout.episodes.harness import RolloutHarness
from rlhf_lightning.rollout.servers.engine import VLLMServerEngine


class ServerRolloutsFailed(ProducerFailed):
    """The rollout thread failed (a server gone, a request refused, an env error)."""


class ServerTransport:
    """The servers and the thread that runs the episodes on them.

    Args:
        engine: the servers (not started yet; started by :meth:`start`).
        harness: the episodes' driver (the thread's own, not the trainer's evaluation harness).
        policy: the trainer's policy, whose weights each published version is.
        lockstep: ``rollout.max_staleness == 0`` (no thread: each batch runs when it is asked for).
    """

    kind = "vllm_server"  # a checkpoint's versions are these runs' files

    def __init__(
        self, engine: VLLMServerEngine, harness: RolloutHarness, policy: Any, lockstep: bool
    ) -> None:
        self.engine, self.harness, self.policy, self.lockstep = engine, harness, policy, lockstep
        self.published: set[int] = set()
        self.pending: deque[Request] = deque()
        self.done: dict[int, Produced] = {}
        self.failure: BaseException | None = None
        self.thread: threading.Thread | None = None
        self.stopping = False
        self.idle_s = 0.0  # the thread's waits for requests and versions since its last batch
        self.calls = CallLog()
        self.cond = threading.Condition()

    def start(self, source: BatchSource, calls: CallLog) -> None:
        self.calls = calls
        self.engine.bind_rank(source.rank, source.world_size, 0)
        self.engine.start()
        if not self.lockstep:
            self.thread = threading.Thread(target=self.work, name="server-rollouts", daemon=True)
            self.thread.start()

    # ---------------------------------------------------------------- versions
    def publish(self, version: int, source: BatchSource) -> None:
        self.engine.publish(version, self.policy)
        self._published(version)

    def restore(self, version: int, saved: dict[str, bytes]) -> None:
        self.engine.publish_files(version, saved)
        self._published(version)

    def _published(self, version: int) -> None:
        with self.cond:
            self.published.add(version)
            self.cond.notify_all()

    def saved(self, version: int) -> dict[str, bytes] | None:
        return self.engine.files_of(version) if version in self.published else None

    def drop_before(self, version: int) -> None:
        self.engine.drop_before(version)
        with self.cond:
            self.published = {v for v in self.published if v >= version}

    def poll(self) -> None:
        """Nothing to book: the thread records its calls as they start."""

    # ---------------------------------------------------------------- batches
    def submit(self, req: Request) -> None:
        if self.lockstep:  # here, now, with the trainer's generators
            self.done[req.step] = self.produce(req)
            return
        with self.cond:
            self.pending.append(req)
            self.cond.notify_all()

    def receive(self, step: int, timeout_s: float) -> Produced:
        """Batch ``step``; raises the thread's error, or after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
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
                        f"waited {timeout_s:.0f} s for the rollout batch of step {step} "
                        "(rollout.async_timeout_s); the servers answer too slowly"
                    )
                self.cond.wait(min(left, POLL_S))
            return self.done.pop(step)

    # ---------------------------------------------------------------- the thread
    def work(self) -> None:
        """Produce the requested batches in order until stopped; an error is kept for ``receive``."""
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
        started = lambda call, version: self.calls.started(req.step, call, version)  # noqa: E731
        sampler = VersionedSampler(self.engine, self.load, chooser(req, self.newest), req.seed, started)
        result = run_request(self.harness, sampler, req)
        work = time.perf_counter() - t0 - (self.idle_s - idle_before)
        produced = Produced(req.step, result, sampler.used, self.idle_s, work, None, req.seed)
        self.idle_s = 0.0
        return produced

    def newest(self, oldest: int, cap: int) -> int:
        """The newest version published now, between ``oldest`` and ``cap``."""
        with self.cond:
            return max([v for v in self.published if oldest <= v <= cap], default=oldest)

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

    def close(self) -> None:
        """Stop the thread, the engine (its servers, if it started them) and the harness's workers."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        self.engine.shutdown()  # first: a request in flight then fails at once
        if self.thread is not None:
            self.thread.join(timeout=10.0)  # (a daemon: one still in a call cannot hold the process)
        self.harness.close()  # its env-step workers
        self.published.clear()
        self.pending.clear()
        self.done.clear()
        self.thread, self.failure, self.stopping = None, None, False
