"""``rollout.mode=async rollout=vllm_server`` without vLLM: the asynchronous driver over the server
transport (``rollout/asynchronous/servers.py``: the episodes on a thread) against a fake engine: the version plan, the seeds, a server's
error ending the wait at once, the time limit, checkpoints."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from rlhf_lightning.records.sampling import Completion, SamplingParams
from rlhf_lightning.rollout.asynchronous.driver import AsyncDriver
from rlhf_lightning.rollout.asynchronous.plan import AsyncSettings, BatchSource, batch_seed, call_seed
from rlhf_lightning.rollout.asynchronous.servers import ServerRolloutsFailed, ServerTransport
from rlhf_lightning.rollout.servers.client import ServerError
from tests.algorithms.test_async_units import FakeHarness


# ---------------------------------------------------------------- the asynchronous rollouts' thread
class FakeServers:
    """The engine side of ``ServerTransport``: versions as bytes, the version in use, each call's
    (version, seed); ``fail`` raised by the next generate, ``hang`` makes it wait until shutdown."""

    def __init__(self) -> None:
        self.published: dict[int, dict[str, bytes]] = {}
        self.version: int | None = None
        self.calls: list[tuple[int | None, int | None]] = []
        self.fail: BaseException | None = None
        self.hang = threading.Event()
        self.stopped = threading.Event()

    def bind_rank(self, rank: int, world_size: int, local_rank: int) -> None:
        pass

    def start(self) -> None:
        pass

    def publish(self, version: int, policy: Any) -> None:
        self.published[version] = {"w": str(version).encode()}

    def publish_files(self, version: int, files: dict[str, bytes]) -> None:
        self.published[version] = dict(files)

    def files_of(self, version: int) -> dict[str, bytes] | None:
        return self.published.get(version)

    def use(self, version: int) -> None:
        assert version in self.published
        self.version = version

    def drop_before(self, version: int) -> None:
        for v in [v for v in self.published if v < version and v != self.version]:
            del self.published[v]

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        if self.hang.is_set():
            self.stopped.wait(30)
        if self.fail is not None:
            raise self.fail
        self.calls.append((self.version, params.seed))
        return [Completion([10, 11], [-0.1, -0.2], "stop", i) for i in range(len(prompts))]

    def shutdown(self) -> None:
        self.stopped.set()


class Harness(FakeHarness):
    closed = False

    def close(self) -> None:
        self.closed = True


def rollouts(engine: FakeServers, k: int, timeout_s: float = 10.0, max_turns: int = 2) -> AsyncDriver:
    settings = AsyncSettings(max_staleness=k, timeout_s=timeout_s, seed=3)
    transport = ServerTransport(engine, Harness(max_turns), None, k == 0)  # type: ignore[arg-type]
    return AsyncDriver(transport, settings, max_turns)


SAMPLING = SamplingParams(4)
SOURCE = BatchSource(0, dict)


class Plan:
    """Batch ``b`` trains rows ``[b % 3, 3 + b % 3]``."""

    def rows(self, batch: int) -> list[int]:
        return [batch % 3, 3 + batch % 3]


def train(r: AsyncDriver, steps: range) -> list[Any]:
    """The trainer's loop: begin at the fit's first step, take batch s, then publish version s + 1."""
    out = []
    r.begin(steps.start, Plan(), SAMPLING, 2, SOURCE)
    for s in steps:
        result, metrics = r.rollout(s, Plan().rows(s))
        out.append((result, metrics))
        r.updated(s + 1, SOURCE)
    return out


def test_k1_batch_s_is_generated_with_version_s_minus_1_and_each_call_its_seed():
    engine = FakeServers()
    r = rollouts(engine, k=1)
    try:
        out = train(r, range(4))
    finally:
        r.close()
    for s, (result, metrics) in enumerate(out):
        assert {tuple(t.turn_versions) for t in result.trajectories} <= {
            (max(0, s - 1),),
            (max(0, s - 1),) * 2,
        }
        assert float(metrics["async/staleness_max"]) == (1.0 if s else 0.0)
    seeds = [seed for _, seed in engine.calls]
    assert seeds[:2] == [call_seed(batch_seed(3, 0, 0), 0), call_seed(batch_seed(3, 0, 0), 1)]
    # versions no batch needs any more are dropped (the one the thread last used may stay)
    assert {3, 4} <= set(engine.published) <= {2, 3, 4}
    assert engine.stopped.is_set() and r.transport.harness.closed  # type: ignore[attr-defined]


def test_k0_runs_in_the_trainers_thread_with_the_trainers_generator():
    engine = FakeServers()
    r = rollouts(engine, k=0)
    try:
        train(r, range(2))
        assert r.transport.thread is None and [v for v, _ in engine.calls] == [0, 0, 1, 1]
        assert {seed for _, seed in engine.calls} == {None}  # the engine draws from torch's generator
    finally:
        r.close()


def test_a_servers_error_ends_the_trainers_wait_at_once_with_it():
    engine = FakeServers()
    r = rollouts(engine, k=1, timeout_s=60)
    try:
        train(r, range(1))
        engine.fail = ServerError("the vLLM server http://h:1 was killed by SIGKILL; its log: s.log")
        t0 = time.monotonic()
        with pytest.raises(ServerRolloutsFailed, match=r"was killed by SIGKILL; its log: s\.log"):
            train(r, range(1, 4))
        assert time.monotonic() - t0 < 5
    finally:
        r.close()


def test_a_batch_that_never_comes_ends_the_wait_after_async_timeout_s():
    engine = FakeServers()
    engine.hang.set()
    r = rollouts(engine, k=1, timeout_s=0.5)
    t0 = time.monotonic()
    try:
        with pytest.raises(TimeoutError, match=r"rollout\.async_timeout_s"):
            train(r, range(1))
        assert time.monotonic() - t0 < 5
    finally:
        r.close()  # the thread in its call ends with the engine


def test_a_checkpoint_keeps_the_versions_in_flight_and_a_resume_publishes_them_again():
    engine = FakeServers()
    r = rollouts(engine, k=2)
    try:
        train(r, range(3))
        state = r.state_dict(3)
    finally:
        r.close()
    assert state["kind"] == "vllm_server" and sorted(state["versions"]) == [1, 2]
    again = FakeServers()
    resumed = rollouts(again, k=2)
    resumed.load_state_dict(state)
    try:
        train(resumed, range(3, 5))
        assert [v for v, _ in again.calls][:1] == [1]  # batch 3 is generated with version 1 again
        assert again.calls[0][1] == call_seed(batch_seed(3, 0, 3), 0)
    finally:
        resumed.close()
