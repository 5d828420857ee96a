"""The asynchronous driver over a transport written here, in memory: a new transport is a small
class and the driver needs no change. The version plan, the pacing, the row check, the metrics,
checkpoints and resume all come from the driver; the fake only moves work and results."""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

import pytest

from rlhf_lightning.records.sampling import Completion, SamplingParams
from rlhf_lightning.rollout.asynchronous.driver import AsyncDriver, CallLog
from rlhf_lightning.rollout.asynchronous.plan import (
    AsyncSettings,
    BatchSource,
    Produced,
    Request,
    VersionedSampler,
    batch_seed,
    chooser,
    run_request,
)
from tests.algorithms.test_async_units import FakeHarness


class Recorder:
    """An engine that answers two tokens whose log-prob is the version it was loaded with."""

    def __init__(self) -> None:
        self.version = -1
        self.seeds: list[int | None] = []

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        self.seeds.append(params.seed)
        return [Completion([7, 8], [float(self.version)] * 2, "stop", i) for i in range(len(prompts))]


class InMemoryTransport:
    """The smallest transport: versions in a dict, requests queued and run when the trainer asks
    for their batch (as a transport whose other side works while the trainer waits)."""

    kind = "in_memory"

    def __init__(self, max_turns: int = 2) -> None:
        self.harness, self.engine = FakeHarness(max_turns), Recorder()
        self.versions: dict[int, Any] = {}
        self.queue: deque[Request] = deque()
        self.calls = CallLog()
        self.log: list[tuple[str, Any]] = []
        self.fail: BaseException | None = None
        self.lock = threading.Lock()

    def start(self, source: BatchSource, calls: CallLog) -> None:
        self.calls = calls
        self.log.append(("start", source.rank))

    def publish(self, version: int, source: BatchSource) -> None:
        self.versions[version] = source.weights()
        self.log.append(("publish", version))

    def restore(self, version: int, saved: Any) -> None:
        self.versions[version] = saved
        self.log.append(("restore", version))

    def saved(self, version: int) -> Any | None:
        return self.versions.get(version)

    def drop_before(self, version: int) -> None:
        for v in [v for v in self.versions if v < version]:
            del self.versions[v]

    def poll(self) -> None:
        pass

    def submit(self, req: Request) -> None:
        self.queue.append(req)
        self.log.append(("submit", req.step))

    def receive(self, step: int, timeout_s: float) -> Produced:
        if self.fail is not None:
            raise self.fail
        req = self.queue.popleft()

        def load(version: int) -> None:
            assert version in self.versions, f"version {version} was dropped or never published"
            self.engine.version = version

        def newest(oldest: int, cap: int) -> int:
            return max(v for v in self.versions if oldest <= v <= cap)

        started = lambda call, version: self.calls.started(req.step, call, version)  # noqa: E731
        sampler = VersionedSampler(self.engine, load, chooser(req, newest), req.seed, started)
        result = run_request(self.harness, sampler, req)
        return Produced(req.step, result, sampler.used, 0.0, 0.0, None, req.seed)

    def close(self) -> None:
        self.log.append(("close", None))
        self.queue.clear()


class Plan:
    """Batch ``b`` trains rows ``[b % 3, 3 + b % 3]``."""

    def rows(self, batch: int) -> list[int]:
        return [batch % 3, 3 + batch % 3]


def source(version: int) -> BatchSource:
    return BatchSource(0, lambda: {"w": version})


def driver(k: int, transport: InMemoryTransport | None = None, **settings: Any) -> AsyncDriver:
    return AsyncDriver(
        transport or InMemoryTransport(), AsyncSettings(max_staleness=k, seed=5, **settings), 2
    )


def train(d: AsyncDriver, steps: range) -> list[tuple[Any, dict]]:
    """The trainer's loop: begin at the fit's first step, take batch s, then publish version s + 1."""
    d.begin(steps.start, Plan(), SamplingParams(4), 2, source(steps.start))
    out = []
    for s in steps:
        out.append(d.rollout(s, Plan().rows(s)))
        d.updated(s + 1, source(s + 1))
    return out


def test_k2_batches_use_version_s_minus_2_with_their_own_seeds_and_are_requested_ahead():
    d = driver(2)
    out = train(d, range(4))
    t: InMemoryTransport = d.transport  # type: ignore[assignment]
    for s, (result, metrics) in enumerate(out):
        v = max(0, s - 2)
        assert {tuple(x.turn_versions) for x in result.trajectories} <= {(v,), (v, v)}
        assert {lp for x in result.trajectories for lp in x.sampling_logps if lp != 0.0} <= {float(v)}
        assert float(metrics["async/staleness_max"]) == float(s - v)
    # Paced: batches 0..2 requested at the start, then one per update (K ahead): s + 2 after update s.
    submits = [step for kind, step in t.log if kind == "submit"]
    assert submits == [0, 1, 2, 3, 4, 5, 6]
    after_publish = [t.log[i + 1] for i, e in enumerate(t.log) if e[0] == "publish" and e[1] >= 1]
    assert after_publish == [("submit", v + 2) for v in range(1, 5)]
    assert t.engine.seeds[0] is not None and batch_seed(5, 0, 0) != batch_seed(5, 0, 1)
    assert sorted(t.versions) == [2, 3, 4]  # older than the newest - K are dropped


def test_k0_is_lockstep_each_batch_requested_when_its_step_starts_with_the_current_version():
    d = driver(0)
    out = train(d, range(3))
    t: InMemoryTransport = d.transport  # type: ignore[assignment]
    assert [step for kind, step in t.log if kind == "submit"] == [0, 1, 2]
    for s, (result, _) in enumerate(out):
        assert {v for x in result.trajectories for v in x.turn_versions} == {s}
    assert set(t.engine.seeds) == {None}  # no seed of its own: the trainer's generators


def test_a_batch_for_other_rows_is_refused_and_a_transports_error_reaches_the_trainer():
    d = driver(1)
    d.begin(0, Plan(), SamplingParams(4), 2, source(0))
    with pytest.raises(RuntimeError, match=r"train loader's order changed"):
        d.rollout(0, [2, 1])
    with pytest.raises(RuntimeError, match="was not requested"):
        d.take(7, [0])
    d.transport.fail = TimeoutError("waited 1 s (rollout.async_timeout_s)")  # type: ignore[attr-defined]
    with pytest.raises(TimeoutError, match=r"rollout\.async_timeout_s"):
        d.rollout(1, Plan().rows(1))


def test_a_checkpoint_resumes_on_a_new_transport_with_the_versions_in_flight():
    d = driver(2)
    train(d, range(3))
    state = d.state_dict(3)
    d.close()
    assert state["kind"] == "in_memory" and sorted(state["versions"]) == [1, 2]
    resumed = driver(2)
    resumed.load_state_dict(state)
    out = train(resumed, range(3, 5))
    t: InMemoryTransport = resumed.transport  # type: ignore[assignment]
    assert [kind for kind, _ in t.log[:3]] == ["start", "restore", "restore"]
    assert {v for x in out[0][0].trajectories for v in x.turn_versions} == {1}  # batch 3: version 1 again
    # A checkpoint of another transport's kind: its versions are not restored, the current
    # weights stand in for them (with a warning).
    other = driver(2)
    other.load_state_dict({**state, "kind": "producer"})
    assert other.restored == {} and other.replay == {}


def test_a_closed_driver_keeps_the_versions_a_second_fit_needs():
    d = driver(1)
    train(d, range(2))
    d.close()
    assert sorted(d.restored) == [1, 2] and d.transport.log[-1] == ("close", None)  # type: ignore[attr-defined]
    out = train(d, range(2, 3))  # fit 2 from step 2: batch 2 at version 1, restored
    assert {v for x in out[0][0].trajectories for v in x.turn_versions} == {1}
