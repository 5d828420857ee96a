"""The producer-process transport of asynchronous rollouts (``rollout.mode=async`` with an engine
of the trainer's own: ``rollout=hf`` or colocated ``rollout=vllm``).

The producer (:mod:`~rlhf_lightning.rollout.asynchronous.producer`) is a process of its own with
its own copy of the model. Messages travel over one-way pipes under deadlines; versions, requests
and batches as files in ``<run>/.async/rank<r>/`` (written atomically, named in the message), so
a producer that dies (killed, out of memory) ends the run with an error within
``rollout.async_timeout_s`` at the latest (at once when it is gone), and a trainer that dies
takes its producer with it. In lockstep (``K = 0``) a request carries the trainer's RNG states
and its batch brings them back, so the trainer continues after the producer's draws.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from rlhf_lightning.rollout.asynchronous.driver import CallLog
from rlhf_lightning.rollout.asynchronous.plan import (
    POLL_S,
    AsyncSettings,
    BatchSource,
    Placement,
    Produced,
    ProducerFailed,
    Request,
    Weights,
    placement,
)
from rlhf_lightning.rollout.asynchronous.producer import dump, load_spooled, producer_main
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


class ProcessTransport:
    """The producer process, its pipes and its spool directory.

    Args:
        build: builds the producer's (harness, engine, policy) on a :class:`Placement`, in its
            process (picklable).
        settings: the staleness bound (which versions to keep), the producer's threads,
            ``rollout.devices`` and the spool's directory.
    """

    kind = "producer"  # a checkpoint's versions are tensors

    def __init__(self, build: Callable[[Placement], tuple[Any, Any, Any]], settings: AsyncSettings) -> None:
        self.build, self.s = build, settings
        self.store: dict[int, Path] = {}  # published versions a request or a checkpoint may need: files
        self.sent: set[int] = set()  # versions the producer has
        self.arrived: dict[int, Path] = {}  # batches the producer wrote that the trainer has not taken
        self.calls = CallLog()
        self.rank = 0
        self.place = Placement()
        self.proc: Any = None
        self.commands: Writer | None = None
        self.results: Reader | None = None
        self._spool: Path | None = None
        self._temporary: Path | None = None  # the spool's own temporary directory, if it made one

    # ---------------------------------------------------------------- the process
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

    def start(self, source: BatchSource, calls: CallLog) -> None:
        """Start the producer for ``source``'s rank, where ``rollout.devices`` places it, and
        wait until it has built its parts."""
        self.calls, self.rank = calls, source.rank
        self.place = placement(self.s.devices, source.rank, source.world_size, source.device)
        self.spawn()

    def spawn(self) -> None:
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
        self.wait_for(
            "ready", "the rollout producer to start (build its model, env and engine)", None, self.s.timeout_s
        )
        for v in sorted(self.store):
            self.send_weights(v)

    def _producer_gone(self, what: str) -> ProducerFailed:
        kill_and_reap(self.proc, timeout_s=5.0)
        return ProducerFailed(
            f"the rollout producer (pid {self.proc.pid}) {describe_exit(self.proc.exitcode)} while the "
            f"trainer waited for {what} (its error, if any, is on stderr above; a script that starts a "
            "run needs an `if __name__ == '__main__':` guard: the producer is spawned). The last "
            "checkpoint resumes the run (resume=true)"
        )

    def _handle(self, message: tuple[Any, ...], what: str) -> None:
        """Book one message from the producer."""
        kind = message[0]
        if kind == "error":
            raise ProducerFailed(f"the rollout producer failed:\n{message[1]}")
        if kind == "turn":
            _, step, call, version = message
            self.calls.started(step, call, version)
        elif kind == "batch":
            self.arrived[message[1]] = Path(message[2])
        elif kind != "ready":
            raise ProducerFailed(f"the rollout producer sent {kind!r} while the trainer waited for {what}")

    def wait_for(self, kind: str, what: str, step: int | None, timeout_s: float) -> Any:
        """Wait for a message of ``kind`` (``batch``: the batch of ``step``, its path); raises
        with the producer's traceback if it failed, and with ``what`` if it is gone or
        ``timeout_s`` (``rollout.async_timeout_s``) passes first."""
        assert self.results is not None
        deadline = time.monotonic() + timeout_s
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
                        f"waited {timeout_s:.0f} s for {what} (rollout.async_timeout_s); the producer "
                        f"(pid {self.proc.pid}) is alive but sent nothing"
                    ) from None
                continue
            self._handle(message, what)
            if kind == "ready" and message[0] == "ready":
                return message[1]
        return self.arrived.pop(step)

    def poll(self) -> None:
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
        """Stop the producer (at the end of a fit, or when it failed) and empty the spool."""
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
        if self._spool is not None:
            shutil.rmtree(self._temporary or self._spool, ignore_errors=True)
            self._spool = self._temporary = None
        self.store.clear()
        self.sent.clear()  # a producer started again (a second fit) gets every version anew
        self.arrived.clear()

    # ---------------------------------------------------------------- versions
    def publish(self, version: int, source: BatchSource) -> None:
        self.publish_weights(version, source.weights())

    def restore(self, version: int, saved: Weights) -> None:
        self.publish_weights(version, saved)

    def publish_weights(self, version: int, weights: Weights) -> None:
        """Version ``version`` of the trainable weights as a file in the spool, sent to a running
        producer."""
        path = self.spool / f"weights-{version}.safetensors"
        tmp = path.with_name(f".tmp-{path.name}")
        save_file({k: v.detach().contiguous() for k, v in weights.items()}, str(tmp))
        os.replace(tmp, path)
        self.store[version] = path
        if self.proc is not None:
            self.send_weights(version)

    def send_weights(self, version: int) -> None:
        if version not in self.sent and version in self.store:
            self.send(("weights", version, str(self.store[version])))
            self.sent.add(version)

    def saved(self, version: int) -> Weights | None:
        path = self.store.get(version)
        return load_file(path) if path is not None and path.exists() else None

    def drop_before(self, version: int) -> None:
        for old in [v for v in self.store if v < version]:
            self.store.pop(old).unlink(missing_ok=True)

    # ---------------------------------------------------------------- batches
    def submit(self, req: Request) -> None:
        """The request as a spool file named in a message; its versions (and a replay's) first.
        In lockstep it carries the trainer's RNG states."""
        for v in sorted({*req.versions, *req.replay}):
            self.send_weights(v)  # the later versions of a planned partial rollout follow as published
        if req.seed is None:
            req = replace(req, rng_state=rng.capture())
        path = self.spool / f"request-{req.step}.pkl"
        write_atomic(path, dump(req))
        self.send(("generate", str(path)))

    def receive(self, step: int, timeout_s: float) -> Produced:
        path = self.wait_for("batch", f"the rollout batch of step {step}", step, timeout_s)
        produced: Produced = load_spooled(path)
        if produced.rng_state is not None:
            rng.restore(produced.rng_state)  # lockstep: the trainer continues after the sampling draws
        return produced
