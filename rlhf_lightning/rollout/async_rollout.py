"""Asynchronous rollouts (``rollout.mode=async``): the trainer's side of the producer process.

Which version each batch and turn uses: :mod:`~rlhf_lightning.rollout.async_plan` (no token
more than ``rollout.max_staleness`` versions old). It is *paced*, not filtered: a request for batch s goes out as soon
as its first version is published, so every prompt the sampler yields is trained on, in order.
Which version (except for ``newest`` partial turns) and which seed a batch uses is fixed in
advance, never by timing, so a run is reproducible and a resume (``resume=true``) regenerates
the batches in flight: the checkpoint keeps the K versions before its step and, for ``newest``
partial turns, the versions their calls started with (:meth:`AsyncRollouts.state_dict`), which
the regenerated calls use again. ``planned`` makes the whole run reproducible, but a later turn
then waits for weights the trainer has not published yet (the producer idles, then the trainer
waits for it); ``newest`` never waits.

``K = 0`` runs the same requests in lockstep (each batch requested when its step starts, with
the trainer's RNG states handed over and back), so its batches are the synchronous run's.

Faults: messages travel over one-way pipes under deadlines and batches and weights as files in
``<run>/.async/rank<r>/`` (:mod:`~rlhf_lightning.rollout.async_producer`), so a producer that
dies (killed, out of memory) ends the run with an error within ``rollout.async_timeout_s`` at
the latest (at once when it is gone), and a trainer that dies takes its producer with it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from rlhf_lightning.records.result import RolloutResult
from rlhf_lightning.records.sampling import SamplingParams
from rlhf_lightning.rollout.async_plan import (
    AsyncSettings,
    BatchSource,
    ProducerFailed,
    RowPlan,
    Weights,
    batch_seed,
    placement,
    turn_versions,
)
from rlhf_lightning.rollout.async_producer import (
    POLL_S,
    Placement,
    Produced,
    Request,
    dump,
    load_spooled,
    producer_main,
)
from rlhf_lightning.runtime import rng
from rlhf_lightning.runtime.channel import (
    ChannelClosed,
    ChannelTimeout,
    Reader,
    Writer,
    take_fd,
    write_atomic,
)
from rlhf_lightning.runtime.children import describe_exit, kill_and_reap

log = logging.getLogger(__name__)


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
        self.store: dict[int, Path] = {}  # published versions a request or a checkpoint may need: files
        self.restored: dict[int, Weights] = {}  # versions from a checkpoint (or a closed producer's)
        self.sent: set[int] = set()  # versions the producer has
        self.requested: dict[int, list[int]] = {}  # step -> rows, for requests in flight
        self.arrived: dict[int, Path] = {}  # batches the producer wrote that the trainer has not taken
        self.turns: dict[int, list[int]] = {}  # step -> the versions its calls started with
        self.replay: dict[int, list[int]] = {}  # the same, from a checkpoint: used again
        self.rank = 0
        self.place = Placement()
        self.proc: Any = None
        self.commands: Writer | None = None
        self.results: Reader | None = None
        self._spool: Path | None = None
        self._temporary: Path | None = None  # the spool's own temporary directory, if it made one
        self.plan: RowPlan | None = None  # the rows of each batch, handed over by begin()
        self.sampling, self.group_size = SamplingParams(), 1

    # ---------------------------------------------------------------- process
    @property
    def spool(self) -> Path:
        """This rank's spool directory (``<run>/.async/rank<r>``), emptied when first used: files
        from an earlier, killed run are never read."""
        if self._spool is None:
            if self.s.spool_dir:
                base = Path(self.s.spool_dir)
            else:  # no run directory (tests, the Python API without one): a private temporary one
                self._temporary = base = Path(tempfile.mkdtemp(prefix="rlhf-async-"))
            spool = base / ".async" / f"rank{self.rank}"
            shutil.rmtree(spool, ignore_errors=True)
            spool.mkdir(parents=True, mode=0o700)
            self._spool = spool
        return self._spool

    def start(self) -> None:
        """Start the producer process and wait until it has built its parts."""
        ctx = mp.get_context("spawn")
        commands_end, commands = ctx.Pipe(duplex=False)  # (read end, write end)
        results, results_end = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(
            target=producer_main,
            args=(
                self.build,
                commands_end,
                results_end,
                self.s.threads,
                os.getpid(),
                str(self.spool),
                self.place,
            ),
            name="rollout-producer",
            daemon=True,
        )
        try:
            self.proc.start()
        finally:
            commands_end.close()  # the producer's ends: closed here, a dead producer is an end of file
            results_end.close()
        self.commands, self.results = Writer(take_fd(commands)), Reader(take_fd(results))
        self.receive("ready", "the rollout producer to start (build its model, env and engine)")

    def _producer_gone(self, what: str) -> ProducerFailed:
        kill_and_reap(self.proc, timeout_s=5.0)
        return ProducerFailed(
            f"the rollout producer (pid {self.proc.pid}) {describe_exit(self.proc.exitcode)} while the "
            f"trainer waited for {what} (its error, if any, is on stderr above; a script that starts a "
            "run needs an `if __name__ == '__main__':` guard: the producer is spawned). The last "
            "checkpoint resumes the run (resume=true)"
        )

    def _handle(self, message: tuple[Any, ...], what: str) -> Any:
        """Book one message from the producer; returns its value for ``ready``/``batch``."""
        kind = message[0]
        if kind == "error":
            raise ProducerFailed(f"the rollout producer failed:\n{message[1]}")
        if kind == "turn":
            _, step, call, version = message
            self.turns.setdefault(step, []).append(version)
            assert len(self.turns[step]) == call + 1, (step, call, self.turns[step])
        elif kind == "batch":
            self.arrived[message[1]] = Path(message[2])
        elif kind != "ready":
            raise ProducerFailed(f"the rollout producer sent {kind!r} while the trainer waited for {what}")
        return message[1]

    def receive(self, kind: str, what: str, step: int | None = None) -> Any:
        """Wait for a message of ``kind`` (``batch``: the batch of ``step``); raises with the
        producer's traceback if it failed, and with ``what`` if it is gone or
        ``rollout.async_timeout_s`` passes first."""
        assert self.results is not None
        deadline = time.monotonic() + self.s.timeout_s
        while kind != "batch" or step not in self.arrived:
            try:
                message = self.results.recv(POLL_S)
            except ChannelClosed:
                raise self._producer_gone(what) from None
            except ChannelTimeout:
                if not self.proc.is_alive():
                    raise self._producer_gone(what) from None
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"waited {self.s.timeout_s:.0f} s for {what} (rollout.async_timeout_s); the producer "
                        f"(pid {self.proc.pid}) is alive but sent nothing"
                    ) from None
                continue
            value = self._handle(message, what)
            if kind == "ready" and message[0] == "ready":
                return value
        return self.arrived.pop(step)

    def drain(self) -> None:
        """Book the messages that are there now, without waiting (a checkpoint's turn versions)."""
        if self.results is None:
            return
        try:
            while self.results.poll(0.0):
                self._handle(self.results.recv(POLL_S), "nothing (draining)")
        except (ChannelClosed, ChannelTimeout):
            pass  # the next wait reports a producer that is gone

    def send(self, message: tuple[Any, ...]) -> None:
        """A small message to the producer (bounded by ``rollout.async_timeout_s``)."""
        assert self.commands is not None
        try:
            self.commands.send(message, self.s.timeout_s)
        except ChannelClosed:
            raise self._producer_gone(f"it to take {message[0]!r}") from None

    def close(self) -> None:
        """Stop the producer (at the end of a fit, or when it failed) and empty the spool; the
        versions a later start needs stay in memory."""
        if self.proc is not None:
            if self.proc.is_alive() and self.commands is not None:
                with contextlib.suppress(ChannelClosed, ChannelTimeout):
                    self.commands.send(("stop",), 1.0)
                self.proc.join(timeout=10)
            kill_and_reap(self.proc)
            self.proc = None
        for end in (self.commands, self.results):
            if end is not None:
                end.close()
        self.commands = self.results = None
        self.restored.update({v: load_file(p) for v, p in self.store.items() if p.exists()})
        if self._spool is not None:
            shutil.rmtree(self._temporary or self._spool, ignore_errors=True)
            self._spool = self._temporary = None
        self.store.clear()
        self.sent.clear()  # a producer started again (a second fit) gets every version anew
        self.requested.clear()
        self.arrived.clear()
        self.turns.clear()

    # ---------------------------------------------------------------- versions and requests
    def publish(self, version: int, weights: Weights) -> None:
        """Version ``version`` of the trainable weights (after that many updates), as a file in
        the spool; older versions no request or checkpoint needs any more are dropped."""
        path = self.spool / f"weights-{version}.safetensors"
        tmp = path.with_name(f".tmp-{path.name}")
        save_file({k: v.detach().contiguous() for k, v in weights.items()}, str(tmp))
        os.replace(tmp, path)
        self.store[version] = path
        self.restored.pop(version, None)
        for old in [v for v in self.store if v < version - self.s.max_staleness]:
            self.store.pop(old).unlink(missing_ok=True)
        if self.proc is not None:
            self.send_weights(version)

    def send_weights(self, version: int) -> None:
        if version not in self.sent and version in self.store:
            self.send(("weights", version, str(self.store[version])))
            self.sent.add(version)

    def request(self, step: int, rows: list[int], sampling: SamplingParams, group_size: int) -> None:
        """Ask for batch ``step`` (its first version must be published)."""
        versions = turn_versions(
            step, self.s.max_staleness, self.s.partial and not self.s.newest, self.max_turns
        )
        replay = self.replay.pop(step, [])
        for v in sorted({*versions, *replay}):
            self.send_weights(v)  # the later versions of a planned partial rollout follow as published
        lockstep = self.s.max_staleness == 0
        req = Request(
            step,
            list(rows),
            versions,
            group_size,
            replace(sampling),
            seed=None if lockstep else batch_seed(self.s.seed, self.rank, step),
            rng_state=rng.capture() if lockstep else None,
            newest=self.s.newest,
            replay=replay,
        )
        path = self.spool / f"request-{step}.pkl"
        write_atomic(path, dump(req))
        self.send(("generate", str(path)))
        self.requested[step] = list(rows)

    def take(self, step: int, rows: list[int]) -> Produced:
        """Batch ``step``, which the trainer is about to train on ``rows`` (checked against the
        rows it was requested for); in lockstep (K = 0) requested now."""
        if self.s.max_staleness == 0 and step not in self.requested:
            raise RuntimeError(f"batch {step} was not requested (AsyncRollouts.take called out of order)")
        path = self.receive("batch", f"the rollout batch of step {step}", step)
        produced: Produced = load_spooled(path)
        wanted = self.requested.pop(produced.step, None)
        self.turns.pop(produced.step, None)
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
    def version_weights(self, version: int) -> Weights | None:
        if version in self.store:
            return load_file(self.store[version])
        return self.restored.get(version)

    def state_dict(self, batches_done: int) -> dict[str, Any]:
        """What a resume needs to regenerate the batches in flight: the versions before
        ``batches_done`` that they use (the current weights are in the checkpoint anyway) and,
        for ``newest`` partial turns, the versions their calls have started with so far."""
        keep = range(max(0, batches_done - self.s.max_staleness), batches_done)
        versions = {v: w for v in keep if (w := self.version_weights(v)) is not None}
        self.drain()
        turns = {step: list(self.turns.get(step, [])) for step in self.requested if self.turns.get(step)}
        return {"versions": versions, "turns": turns}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.restored.update({int(v): w for v, w in state.get("versions", {}).items()})
        self.replay = {int(step): [int(v) for v in vs] for step, vs in state.get("turns", {}).items()}

    # ---------------------------------------------------------------- one training step
    def begin(
        self, step: int, plan: RowPlan, sampling: SamplingParams, group_size: int, source: BatchSource
    ) -> None:
        """At the start of a fit, before batch ``step``: publish the current weights as version
        ``step``, start the producer, and request the batches ``step .. step + K``, each for the
        rows ``plan`` gives it (their versions are this one or the checkpoint's)."""
        if self.proc is not None:
            return
        self.plan, self.sampling, self.group_size = plan, replace(sampling), group_size
        self.rank = source.rank
        self.place = placement(self.s.devices, source.rank, source.world_size, source.device)
        current = source.weights()
        for v, weights in sorted(self.restored.items()):  # a checkpoint's versions, as files now
            self.publish(v, weights)
        missing = [v for v in range(max(0, step - self.s.max_staleness), step) if v not in self.store]
        if missing:  # e.g. a synchronous run's checkpoint resumed with rollout.mode=async
            log.warning(
                "asynchronous rollouts: versions %s are not in the checkpoint; using version %d",
                missing,
                step,
            )
            for v in missing:
                self.publish(v, current)
        self.publish(step, current)
        self.start()
        for v in sorted(self.store):
            self.send_weights(v)
        if self.s.max_staleness > 0:
            for b in range(step, step + self.s.max_staleness + 1):
                self.request(b, plan.rows(b), sampling, group_size)

    def rollout(self, step: int, rows: list[int]) -> tuple[RolloutResult, dict[str, torch.Tensor]]:
        """Batch ``step``, which the trainer trains on ``rows`` (in lockstep, K = 0, requested
        now), and its ``async/*`` metrics: token staleness, the trainer's and the producer's waits."""
        if self.proc is None or self.plan is None:
            raise RuntimeError("asynchronous rollouts: batch requested before begin() (the fit's start)")
        if self.s.max_staleness == 0:
            self.request(step, rows, self.sampling, self.group_size)
        t0 = time.perf_counter()
        produced = self.take(step, rows)
        waited = time.perf_counter() - t0
        return produced.result, self.metrics(produced, step, waited)

    def updated(self, version: int, source: BatchSource) -> None:
        """The trainer finished update ``version - 1``: publish its weights and request the batch
        that is generated with them (``version + K``)."""
        if self.proc is None or self.plan is None:
            return
        self.publish(version, source.weights())
        if self.s.max_staleness > 0:
            b = version + self.s.max_staleness
            self.request(b, self.plan.rows(b), self.sampling, self.group_size)

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
