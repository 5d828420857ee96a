"""The rollout producer of asynchronous rollouts (``rollout.mode=async``): a process of its own
with its own copy of the model, which runs the harness on the rows and weights the trainer sends.

The trainer decides everything (which step, which rows, which policy version each turn uses,
which random seed); the producer executes its requests in order. So what a batch contains never
depends on timing: a run is reproducible, and a resumed run regenerates the same batches.

Messages (queues between our own two processes; objects travel as :func:`pack` bytes):

    trainer -> producer   ("weights", version, {name: tensor})   a published policy version
                          ("generate", Request)                   a batch to produce
                          ("stop",)
    producer -> trainer   ("ready", pid) once built; ("batch", Produced); ("error", traceback)

Weights reach the engine when a generate call needs their version: copied into the producer's
policy (the HF engine samples that policy itself), then ``engine.ensure_synced`` (a vLLM engine
loads the LoRA adapter in place, or reloads every weight with full fine-tuning).
"""

from __future__ import annotations

import os
import pickle
import queue
import random
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from rlhf_lightning.envs.harness import RolloutResult
from rlhf_lightning.rollout.engine import Completion, SamplingParams
from rlhf_lightning.runtime import rng

POLL_S = 0.5  # how often a wait looks up from its queue (the other process's liveness)


def pack(obj: Any) -> bytes:
    """``obj`` as bytes for the other process: tensors by value, not as shared-memory handles
    (which die with the process that made them, and cost a descriptor each)."""
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def unpack(data: bytes) -> Any:
    """What :func:`pack` made, in the other one of our own two processes (never user data)."""
    return pickle.loads(data)


@dataclass(frozen=True)
class Placement:
    """Where a rank's producer runs: its torch ``device`` (``cpu``, or ``cuda:<i>``) and the
    trainer's ``rank`` of ``world_size`` (a vLLM engine's seed and staging directory follow it)."""

    device: str = "cpu"
    rank: int = 0
    world_size: int = 1

    @property
    def cuda_index(self) -> int | None:
        return int(self.device.split(":")[1]) if self.device.startswith("cuda:") else None


def call_seed(seed: int, call: int) -> int:
    """The sampling seed of generate call ``call`` of a batch seeded with ``seed`` (an engine with
    its own generator, vLLM, seeds each prompt from it: a regenerated batch draws the same)."""
    return (seed * 1_000_003 + call * 7_919) % 2**31


@dataclass(frozen=True)
class Request:
    """One batch to produce.

    Attributes:
        step: the training step (batches done before it) that will train on it.
        rows: the env rows, as the train loader yields them for that step.
        versions: the policy version of each generate call (turn); the last repeats.
        group_size, sampling: as in a synchronous rollout.
        seed: seeds the producer's generators for this batch (``max_staleness >= 1``), or None.
        rng_state: the trainer's RNG states to continue from and hand back (``max_staleness=0``:
            the same random numbers as a synchronous run), or None.
    """

    step: int
    rows: list[int]
    versions: list[int]
    group_size: int
    sampling: SamplingParams
    seed: int | None = None
    rng_state: dict[str, Any] | None = None


@dataclass
class Produced:
    """A produced batch: its rollout (every trajectory's ``turn_versions`` set), the versions of
    its generate calls, how long the producer waited for weights or requests while producing it
    and how long it generated, and (``rng_state`` requests) the RNG states after it."""

    step: int
    result: RolloutResult
    call_versions: list[int]
    wait_s: float
    work_s: float
    rng_state: dict[str, Any] | None = None


class VersionedSampler:
    """The engine with the version of each generate call put in place first (``load``), so a
    turn of a partial rollout runs on newer weights than the turn before. Records the versions."""

    def __init__(
        self, engine: Any, load: Callable[[int], None], versions: list[int], seed: int | None = None
    ) -> None:
        self.engine, self.load, self.versions, self.seed = engine, load, versions, seed
        self.used: list[int] = []

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> list[Completion]:
        version = self.versions[min(len(self.used), len(self.versions) - 1)]
        self.load(version)
        if self.seed is not None:
            params = replace(params, seed=call_seed(self.seed, len(self.used)))
        self.used.append(version)
        return self.engine.generate(prompt_token_ids, params)


def seed_all(seed: int) -> None:
    """Python's, NumPy's and torch's global generators from one seed."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class Producer:
    """The producer's loop state: the harness, the engine, the policy and its parameters by name,
    the versions received, the requests not yet served. ``build(place)`` makes the first three."""

    def __init__(
        self,
        build: Callable[[Placement], tuple[Any, Any, Any]],
        commands: Any,
        parent_pid: int,
        place: Placement = Placement(),
    ) -> None:
        self.harness, self.engine, self.policy = build(place)
        self.params = dict(self.policy.named_parameters())
        self.commands, self.parent_pid = commands, parent_pid
        self.store: dict[int, dict[str, torch.Tensor]] = {}
        self.loaded: int | None = None
        self.pending: deque[Request] = deque()
        self.waited = 0.0

    def receive(self) -> bool:
        """Take one command (waiting as long as it takes while the trainer lives); False on stop."""
        t0 = time.perf_counter()
        while True:
            try:
                message = self.commands.get(timeout=POLL_S)
                break
            except queue.Empty:
                if os.getppid() != self.parent_pid:  # the trainer is gone (e.g. kill -9)
                    raise SystemExit(0) from None
        self.waited += time.perf_counter() - t0
        if message[0] == "stop":
            return False
        if message[0] == "weights":
            self.store[message[1]] = unpack(message[2])
        else:
            self.pending.append(unpack(message[1]))
        return True

    def load(self, version: int) -> None:
        """Put ``version``'s weights into the model, waiting for the trainer to publish them."""
        while version not in self.store:
            if not self.receive():
                raise SystemExit(0)
        if self.loaded != version:
            with torch.no_grad():
                for name, value in self.store[version].items():
                    self.params[name].copy_(value)
            self.engine.ensure_synced(self.policy, version)  # an engine with weights of its own
            self.loaded = version

    def produce(self, req: Request) -> Produced:
        """Generate and score ``req``'s batch. Its wait time is every wait since the last batch
        (for this request, then for weights mid-batch)."""
        t0, waited_before = time.perf_counter(), self.waited
        if req.rng_state is not None:
            rng.restore(req.rng_state)
        else:
            seed_all(int(req.seed or 0))
        sampler = VersionedSampler(self.engine, self.load, req.versions, req.seed)
        result = self.harness.rollout(sampler, req.rows, req.sampling, group_size=req.group_size)
        for traj in result.trajectories:
            traj.turn_versions = sampler.used[: traj.num_turns]
        # Later requests never need an older version than this batch's first.
        for old in [v for v in self.store if v < req.versions[0]]:
            del self.store[old]
        after = rng.capture() if req.rng_state is not None else None
        work = time.perf_counter() - t0 - (self.waited - waited_before)
        produced = Produced(req.step, result, sampler.used, self.waited, work, after)
        self.waited = 0.0
        return produced


def producer_main(
    build: Callable[[Placement], tuple[Any, Any, Any]],
    commands: Any,
    results: Any,
    threads: int,
    parent_pid: int,
    place: Placement = Placement(),
) -> None:
    """The producer process: build the parts on ``place``, then serve requests in order until
    told to stop. Any error goes back to the trainer with its traceback (the trainer raises it)."""
    producer = None
    try:
        torch.set_num_threads(threads)
        if place.cuda_index is not None:
            torch.cuda.set_device(place.cuda_index)
        producer = Producer(build, commands, parent_pid, place)
        results.put(("ready", os.getpid()))
        while True:
            while not producer.pending:
                if not producer.receive():
                    return
            results.put(("batch", pack(producer.produce(producer.pending.popleft()))))
    except SystemExit:
        return
    except BaseException:
        results.put(("error", traceback.format_exc()))
    finally:
        if producer is not None:
            producer.engine.shutdown()  # e.g. a vLLM engine's adapter staging directory
