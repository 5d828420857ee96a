"""The rollout producer of asynchronous rollouts (``rollout.mode=async``): a process of its own
with its own copy of the model, which runs the harness on the rows and weights the trainer sends.

The trainer decides which step, which rows, which random seed, and (except for the turns of a
partial rollout in ``newest`` mode) which policy version each turn uses; the producer executes
its requests in order.

Transport (:mod:`rlhf_lightning.runtime.channel`): two one-way pipes carry small messages only,
each read under a deadline; anything large is a file in the run's spool directory, written
atomically and named in the message, so neither side ever blocks on the other's read and a
process that dies mid-write leaves the other an end of file, never a hang:

    trainer -> producer   ("weights", version, path)      a published version (safetensors)
                          ("generate", path)              a pickled Request
                          ("stop",)
    producer -> trainer   ("ready", pid) once built
                          ("turn", step, call, version)   a generate call of batch step starts
                          ("batch", step, path)           a pickled Produced
                          ("error", traceback)

(The trainer's side: :class:`~rlhf_lightning.rollout.asynchronous.process.ProcessTransport`.)
The producer dies with the trainer (``PR_SET_PDEATHSIG``), and exits with ``os._exit`` so no
thread or buffer can hold it at interpreter exit.

Weights reach the engine when a generate call needs their version: copied into the producer's
policy (the HF engine samples that policy itself), then ``engine.ensure_synced`` (a vLLM engine
loads the LoRA adapter in place, or reloads every weight with full fine-tuning).
"""

from __future__ import annotations

import os
import pickle
import random
import sys
import time
import traceback
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from rlhf_lightning.rollout.asynchronous.plan import (
    POLL_S,
    Placement,
    Produced,
    Request,
    Stop,
    VersionedSampler,
    chooser,
    run_request,
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
from rlhf_lightning.runtime.children import die_with_parent, parent_alive

TRAINER_DEVICE = Placement()  # the default: the CPU, rank 0 of 1


def dump(obj: Any) -> bytes:
    """``obj`` as bytes for a spool file of our own two processes."""
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def load_spooled(path: str | Path) -> Any:
    """What the other one of our own two processes wrote with :func:`dump` (never user data: the
    spool directory is private to the run and emptied at its start); the file is removed."""
    data = Path(path).read_bytes()
    Path(path).unlink(missing_ok=True)
    return pickle.loads(data)


def seed_all(seed: int) -> None:
    """Python's, NumPy's and torch's global generators from one seed."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class Producer:
    """The producer's loop state: the harness, the engine, the policy and its parameters by name,
    the versions published (their files), the requests not yet served. ``build(place)`` makes
    the first three; ``results`` (None: nowhere) hears each call's version."""

    def __init__(
        self,
        build: Callable[[Placement], tuple[Any, Any, Any]],
        commands: Reader,
        parent_pid: int,
        place: Placement = TRAINER_DEVICE,
        results: Writer | None = None,
    ) -> None:
        self.harness, self.engine, self.policy = build(place)
        self.params = dict(self.policy.named_parameters())
        self.commands, self.results, self.parent_pid = commands, results, parent_pid
        self.store: dict[int, Path] = {}
        self.loaded: int | None = None
        self.pending: deque[Request] = deque()
        self.waited = 0.0

    # ---------------------------------------------------------------- commands
    def receive(self, wait: bool = True) -> bool:
        """Take one command, waiting as long as the trainer lives (``wait=False``: only one that
        is there now). Returns whether one was taken; raises :class:`Stop` on ``stop``."""
        t0 = time.perf_counter()
        while True:
            try:
                message = self.commands.recv(POLL_S if wait else 0.0)
                break
            except ChannelTimeout:
                if not parent_alive(self.parent_pid):  # the trainer is gone (e.g. kill -9)
                    raise Stop from None
                if not wait:
                    return False
            except ChannelClosed:
                raise Stop from None
        if wait:
            self.waited += time.perf_counter() - t0
        if message[0] == "stop":
            raise Stop
        if message[0] == "weights":
            self.store[message[1]] = Path(message[2])
        else:
            self.pending.append(load_spooled(message[1]))
        return True

    def newest(self, oldest: int, cap: int) -> int:
        """The newest version published now, between ``oldest`` (which must be there) and ``cap``."""
        while self.receive(wait=False):
            pass
        return max([v for v in self.store if oldest <= v <= cap], default=oldest)

    def load(self, version: int) -> None:
        """Put ``version``'s weights into the model, waiting for the trainer to publish them."""
        while version not in self.store:
            self.receive()
        if self.loaded != version:
            weights = load_file(self.store[version])
            with torch.no_grad():
                for name, value in weights.items():
                    self.params[name].copy_(value)
            self.engine.ensure_synced(self.policy, version)  # an engine with weights of its own
            self.loaded = version

    # ---------------------------------------------------------------- one batch
    def produce(self, req: Request) -> Produced:
        """Generate and score ``req``'s batch. Its wait time is every wait since the last batch
        (for this request, then for weights mid-batch)."""
        t0, waited_before = time.perf_counter(), self.waited
        if req.rng_state is not None:
            rng.restore(req.rng_state)
        else:
            seed_all(int(req.seed or 0))
        sampler = VersionedSampler(
            self.engine, self.load, chooser(req, self.newest), req.seed, self.announcer(req.step)
        )
        result = run_request(self.harness, sampler, req)
        # Later requests never need an older version than this batch's first.
        for old in [v for v in self.store if v < req.versions[0]]:
            del self.store[old]
        after = rng.capture() if req.rng_state is not None else None
        work = time.perf_counter() - t0 - (self.waited - waited_before)
        produced = Produced(req.step, result, sampler.used, self.waited, work, after, req.seed)
        self.waited = 0.0
        return produced

    def announcer(self, step: int) -> Callable[[int, int], None] | None:
        """Tell the trainer which version each call of batch ``step`` starts with."""
        if self.results is None:
            return None
        results = self.results
        return lambda call, version: results.send(("turn", step, call, version))


def serve(
    build: Callable[[Placement], tuple[Any, Any, Any]],
    commands: Reader,
    results: Writer,
    threads: int,
    parent_pid: int,
    spool: str | Path,
    place: Placement = TRAINER_DEVICE,
) -> int:
    """Build the parts on ``place``, then serve requests in order until told to stop (or the
    trainer is gone): 0. Any error goes back to the trainer with its traceback: 1."""
    producer = None
    try:
        torch.set_num_threads(threads)
        if place.cuda_index is not None:
            torch.cuda.set_device(place.cuda_index)
        producer = Producer(build, commands, parent_pid, place, results)
        results.send(("ready", os.getpid()))
        while True:
            while not producer.pending:
                producer.receive()
            produced = producer.produce(producer.pending.popleft())
            path = Path(spool) / f"batch-{produced.step}.pkl"
            write_atomic(path, dump(produced))
            results.send(("batch", produced.step, str(path)))
    except (Stop, ChannelClosed):
        return 0
    except BaseException:
        try:
            results.send(("error", traceback.format_exc()), timeout_s=10.0)
        except (ChannelClosed, ChannelTimeout):
            traceback.print_exc()
        return 1
    finally:
        if producer is not None:
            try:
                producer.engine.shutdown()  # e.g. a vLLM engine's adapter staging directory
            except Exception:
                traceback.print_exc()


def producer_main(
    build: Callable[[Placement], tuple[Any, Any, Any]],
    commands_end: Any,
    results_end: Any,
    threads: int,
    parent_pid: int,
    spool: str,
    place: Placement = TRAINER_DEVICE,
) -> None:
    """The producer process (:func:`serve`). ``commands_end`` / ``results_end``: this process's
    ends of the two pipes (``multiprocessing`` connections, taken over as plain descriptors)."""
    die_with_parent(parent_pid)
    code = serve(
        build, Reader(take_fd(commands_end)), Writer(take_fd(results_end)), threads, parent_pid, spool, place
    )
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown (threads, buffers) can hold a finished producer
