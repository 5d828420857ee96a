"""The async settings and the version plan of ``rollout.mode=async``: which policy version and
seed each batch and turn uses, where each rank's producer runs, what the producer needs of the
trainer (:class:`BatchSource`) and the rows it generates for (:class:`RowPlan`); a batch's
:class:`Request` and what comes back (:class:`Produced`), and the sampler that puts each generate
call's version in place first (:class:`VersionedSampler`), whichever transport runs it.

Versions count optimizer updates of whole batches: the weights after training step ``s`` are
version ``s + 1``, and batch ``s`` trains at version ``s``. With ``rollout.max_staleness=K``:

    batch s is generated with version max(0, s - K)            (every turn)
    rollout.partial=true (partial_versions=newest, the default): turn j of batch s with the
        newest version published when it starts: at least max(0, s - K), at most s
    rollout.partial=true partial_versions=planned: turn j with min(max(0, s - K) + j, s)

so no token is more than K versions old, and the producer works on batch s + K while the
trainer updates on batch s (:mod:`~rlhf_lightning.rollout.asynchronous.driver`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, cast

import torch

from rlhf_lightning.records.result import RolloutResult
from rlhf_lightning.records.sampling import Completion, SamplingParams
from rlhf_lightning.rollout.engines.kv_reuse import TurnCache

Weights = dict[str, torch.Tensor]
POLL_S = 0.5  # how often a wait looks up (the other side's liveness)
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
        versions: the policy version of each generate call (turn); the last repeats. With
            ``newest``, only ``versions[0]`` (the oldest allowed) is fixed in advance.
        group_size, sampling: as in a synchronous rollout.
        seed: seeds the producer's generators for this batch (``max_staleness >= 1``), or None.
        rng_state: the trainer's RNG states to continue from and hand back (``max_staleness=0``:
            the same random numbers as a synchronous run), or None.
        newest: each generate call uses the newest version published when it starts (at least
            ``versions[0]``, at most ``step``), never waiting for one (``rollout.partial`` in
            ``newest`` mode).
        replay: the versions the first calls used before a resume (recorded in the checkpoint):
            those calls use them again, whatever is newest.
    """

    step: int
    rows: list[int]
    versions: list[int]
    group_size: int
    sampling: SamplingParams
    seed: int | None = None
    rng_state: dict[str, Any] | None = None
    newest: bool = False
    replay: list[int] = field(default_factory=list)


@dataclass
class Produced:
    """A produced batch: its rollout (every trajectory's ``turn_versions`` set), the versions of
    its generate calls, how long the producer waited for weights or requests while producing it
    and how long it generated, (``rng_state`` requests) the RNG states after it, and the seed
    its generators started from (None: the trainer's RNG states)."""

    step: int
    result: RolloutResult
    call_versions: list[int]
    wait_s: float
    work_s: float
    rng_state: dict[str, Any] | None = None
    seed: int | None = None


class VersionedSampler:
    """The engine with the version of each generate call put in place first (``load``), so a
    turn of a partial rollout can run on newer weights than the turn before.

    ``choose(call)`` picks call ``call``'s version; ``started(call, version)`` hears it before
    the call (the trainer records it for a resume). Records the versions used."""

    def __init__(
        self,
        engine: Any,
        load: Callable[[int], None],
        choose: Callable[[int], int],
        seed: int | None = None,
        started: Callable[[int, int], None] | None = None,
    ) -> None:
        self.engine, self.load, self.choose, self.seed, self.started = engine, load, choose, seed, started
        self.used: list[int] = []
        self.turns: TurnCache | None = None  # the engine's, inside turn_session()

    @contextmanager
    def turn_session(self) -> Iterator[TurnCache | None]:
        """The engine's own turn session where it has one (the harness opens it for
        ``env.history=full``): a turn runs on the KV cache of the turn before, as in a synchronous
        rollout, so lockstep (``max_staleness=0``) samples bitwise what the sync run does."""
        session = getattr(self.engine, "turn_session", None)
        if not callable(session):
            yield None
            return
        with session() as turns:
            self.turns = turns
            try:
                yield turns
            finally:
                self.turns = None

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> list[Completion]:
        call = len(self.used)
        version = self.choose(call)
        if self.started is not None:
            self.started(call, version)
        if self.turns is not None and self.used and version != self.used[-1]:
            self.turns.forget()  # the cache holds the older version's keys and values
        self.load(version)
        if self.seed is not None:
            params = replace(params, seed=call_seed(self.seed, call))
        self.used.append(version)
        return self.engine.generate(prompt_token_ids, params)


def planned(versions: list[int]) -> Callable[[int], int]:
    """Call ``i`` uses ``versions[i]`` (the last one repeats)."""
    return lambda call: versions[min(call, len(versions) - 1)]


def chooser(req: Request, newest: Callable[[int, int], int]) -> Callable[[int], int]:
    """Call ``i``'s version: a replayed one (the checkpoint's), the newest published between
    ``versions[0]`` and the step (``newest(oldest, cap)``, for ``newest`` requests), or the plan's."""
    plan = planned(req.versions)

    def choose(call: int) -> int:
        if call < len(req.replay):
            return req.replay[call]
        if req.newest:
            return newest(req.versions[0], req.step)
        return plan(call)

    return choose


def run_request(harness: Any, sampler: VersionedSampler, req: Request) -> RolloutResult:
    """``req``'s episodes through ``sampler``; each trajectory's ``turn_versions`` are the
    versions its turns were sampled with. The harness's turn ``k`` is generate call ``k``;
    agents (``env=agent``) call the engine through the endpoint in batches of their own, so each
    of their calls records the version of the generate call that served it."""
    if getattr(harness, "records_call_versions", False):
        return cast(
            RolloutResult,
            harness.rollout(
                sampler, req.rows, req.sampling, group_size=req.group_size, version=lambda: sampler.used[-1]
            ),
        )
    result: RolloutResult = harness.rollout(sampler, req.rows, req.sampling, group_size=req.group_size)
    for traj in result.trajectories:
        traj.turn_versions = sampler.used[: traj.num_turns]
    return result


class Stop(Exception):
    """The trainer asked the producer to stop (or is gone)."""
