"""Asynchronous rollouts (``rollout.mode=async``) piece by piece: the producer's loop without a
process and the trainer side, with the fakes below (the version plan, seeds and staleness:
``tests/rollout/test_async_plan.py``).

The fakes are module-level: a spawned producer unpickles ``build_parts`` by name, so it imports
this module (``tests`` is a package and the child inherits ``sys.path``).
"""

from __future__ import annotations

import functools
import os
import random
import threading
import time
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from rlhf_lightning.records.result import RolloutResult
from rlhf_lightning.records.sampling import Completion, SamplingParams
from rlhf_lightning.records.trajectory import Trajectory, collate
from rlhf_lightning.rollout.asynchronous import producer as async_producer
from rlhf_lightning.rollout.asynchronous.driver import AsyncDriver
from rlhf_lightning.rollout.asynchronous.plan import (
    AsyncSettings,
    BatchSource,
    Placement,
    Request,
    Stop,
    VersionedSampler,
    batch_seed,
    call_seed,
    planned,
)
from rlhf_lightning.rollout.asynchronous.process import ProcessTransport
from rlhf_lightning.rollout.asynchronous.producer import Producer
from rlhf_lightning.rollout.engines.base import EngineBase
from rlhf_lightning.runtime import rng
from rlhf_lightning.runtime.channel import Reader, Writer

OBS = 99  # the observation token the fake harness puts between turns
TOKENS_PER_TURN = 2


# ---------------------------------------------------------------- fakes (picklable)
def trajectory(prompt: list[int], turns: list[list[int]], versions: list[int] | None = None) -> Trajectory:
    """A trajectory of ``prompt`` and the generated ``turns`` (log-prob 0)."""
    traj = Trajectory(list(prompt), [-1] * len(prompt), [0.0] * len(prompt), [], 0, len(prompt))
    for k, ids in enumerate(turns):
        append_turn(traj, k, ids, [0.0] * len(ids))
    traj.turn_versions = list(versions or [])
    return traj


def append_turn(traj: Trajectory, turn: int, ids: list[int], logps: list[float]) -> None:
    """Turn ``turn``'s generated ``ids``, after an observation token if it is not the first."""
    obs = [OBS] if turn else []
    traj.token_ids += obs + ids
    traj.action_turn += [-1] * len(obs) + [turn] * len(ids)
    traj.sampling_logps += [0.0] * len(obs) + logps
    traj.rewards.append(0.0)
    traj.turn_lengths.append(len(ids))
    traj.finish_reasons.append("stop")


class FakeEngine(EngineBase):
    """Generates ``TOKENS_PER_TURN`` tokens per prompt, their log-probs the policy's weight (so a
    batch shows which weights generated it), and records each call: the weight and one draw of
    each global generator (Python, NumPy, torch), also handed back in ``Completion.extra``."""

    def __init__(self, policy: torch.nn.Linear) -> None:
        self.policy = policy
        self.calls: list[dict[str, Any]] = []
        self.synced: list[tuple[float, int]] = []  # (the policy's weight, the version) per sync
        self.place: Placement | None = None
        self.shut_down = False

    def shutdown(self) -> None:
        self.shut_down = True

    def ensure_synced(self, policy: torch.nn.Module, version: int) -> None:
        self.synced.append((float(policy.weight.detach().sum()), version))

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> list[Completion]:
        weight = float(self.policy.weight.detach().sum())
        draw = {"torch": float(torch.rand(())), "python": random.random(), "numpy": float(np.random.rand())}
        self.calls.append(
            {"weight": weight, "prompts": [list(p) for p in prompt_token_ids], "seed": params.seed, **draw}
        )
        n = min(TOKENS_PER_TURN, params.max_new_tokens)
        one = Completion(list(range(10, 10 + n)), [weight] * n, "stop", extra=draw)
        return [replace(one, prompt_index=i) for i in range(len(prompt_token_ids))]


class FakeHarness:
    """One engine call per turn for every live episode, as the real harness: the episodes of row
    ``r`` last ``1 + r % max_turns`` turns; each episode's prompt is ``[r]``. Each trajectory's
    ``infos`` holds its turns' completion extras (the engine's draws)."""

    def __init__(self, max_turns: int) -> None:
        self.max_turns = max_turns

    def rollout(
        self, engine: Any, rows: list[int], params: SamplingParams, *, group_size: int = 1
    ) -> RolloutResult:
        trajs = [trajectory([row], []) for row in rows for _ in range(group_size)]
        for i, t in enumerate(trajs):
            t.group_id = i // group_size
        lasts = [1 + t.token_ids[0] % self.max_turns for t in trajs]  # row r: 1 + r % max_turns turns
        for turn in range(self.max_turns):
            live = [i for i, n in enumerate(lasts) if n > turn]
            if not live:
                break
            completions = engine.generate([trajs[i].token_ids for i in live], replace(params, n=1))
            for i, c in zip(live, completions):
                append_turn(trajs[i], turn, c.token_ids, c.logprobs)
                trajs[i].infos.append(c.extra)
        return RolloutResult(collate(trajs, 0), trajs, {})


def tiny_policy() -> torch.nn.Linear:
    """One parameter, ``weight`` (1, 1), set to a value no published version has."""
    policy = torch.nn.Linear(1, 1, bias=False)
    torch.nn.init.constant_(policy.weight, -99.0)
    return policy


def weights_of(version: int) -> dict[str, torch.Tensor]:
    """Version ``version``'s weights: ``weight`` = 10 * version + 1 (so each version is distinct)."""
    return {"weight": torch.full((1, 1), 10.0 * version + 1.0)}


def build_parts(
    place: Placement | None = None, max_turns: int = 2
) -> tuple[FakeHarness, FakeEngine, torch.nn.Module]:
    """The producer's (harness, engine, policy); the engine records its ``place``."""
    policy = tiny_policy()
    engine = FakeEngine(policy)
    engine.place = place
    return FakeHarness(max_turns), engine, policy


def build_failing(place: Placement | None = None) -> tuple[Any, Any, Any]:
    raise ValueError("boom")


def build_sleeping(place: Placement | None = None) -> tuple[Any, Any, Any]:
    time.sleep(120)
    return build_parts()


def build_exiting(place: Placement | None = None) -> tuple[Any, Any, Any]:
    os._exit(3)


@pytest.fixture(autouse=True)
def keep_global_rng():
    """Producer tests seed and restore the global generators: put them back afterwards."""
    state = rng.capture()
    yield
    rng.restore(state)


# ---------------------------------------------------------------- the producer, without a process
def test_versioned_sampler_loads_each_calls_version_then_repeats_the_last():
    loaded: list[int] = []
    started: list[tuple[int, int]] = []
    engine = FakeEngine(tiny_policy())
    sampler = VersionedSampler(
        engine, loaded.append, planned([3, 4]), started=lambda c, v: started.append((c, v))
    )
    outs = [sampler.generate([[k, k + 1]], SamplingParams(max_new_tokens=1)) for k in range(4)]
    assert loaded == [3, 4, 4, 4] and sampler.used == [3, 4, 4, 4]
    assert started == [(0, 3), (1, 4), (2, 4), (3, 4)]  # announced before each call
    assert [c["prompts"] for c in engine.calls] == [[[k, k + 1]] for k in range(4)]  # passed through
    assert all(o[0].token_ids == [10] for o in outs)  # the engine's completions handed back
    assert [c["seed"] for c in engine.calls] == [None] * 4  # no batch seed: the engine's generator


def test_versioned_sampler_gives_each_call_its_own_seed_from_the_batch_seed():
    engine = FakeEngine(tiny_policy())
    sampler = VersionedSampler(engine, lambda v: None, planned([0]), seed=12345)
    for _ in range(3):
        sampler.generate([[1]], SamplingParams(max_new_tokens=1))
    seeds = [c["seed"] for c in engine.calls]
    assert seeds == [(12345 * 1_000_003 + k * 7_919) % 2**31 for k in range(3)]  # call_seed by hand
    assert len(set(seeds)) == 3 and all(0 <= s < 2**31 for s in seeds)


def pipe() -> tuple[Reader, Writer]:
    """Both ends of a one-way pipe in this process."""
    r, w = os.pipe()
    return Reader(r), Writer(w)


def driver_of(transport: ProcessTransport, max_turns: int = 3) -> AsyncDriver:
    return AsyncDriver(transport, transport.s, max_turns=max_turns)


def trainer_side(versions: list[int], **settings: Any) -> tuple[ProcessTransport, Reader]:
    """The trainer's side (the process transport) with ``versions`` published and sent into a
    pipe (its own messages, as it writes them for the process), no process started; and the
    pipe's read end."""
    trainer = ProcessTransport(build_parts, AsyncSettings(**{"max_staleness": 100, **settings}))
    commands, trainer.commands = pipe()
    for v in versions:
        trainer.publish_weights(v, weights_of(v))
        trainer.send_weights(v)
    return trainer, commands


def producer_with(versions: list[int], **settings: Any) -> tuple[Producer, ProcessTransport, FakeEngine]:
    """A producer in this process (three turns) reading what :func:`trainer_side` sent."""
    trainer, commands = trainer_side(versions, **settings)
    producer = Producer(functools.partial(build_parts, max_turns=3), commands, os.getppid())
    assert isinstance(producer.engine, FakeEngine)
    return producer, trainer, producer.engine


def request(step: int, rows: list[int], versions: list[int], **kwargs: Any) -> Request:
    return Request(step, rows, versions, 2, SamplingParams(max_new_tokens=4), **kwargs)


def test_produce_loads_each_turns_version_and_sets_turn_versions():
    producer, _trainer, engine = producer_with([0, 1, 2, 3, 4])
    rows = [0, 2, 1]  # 1, 3 and 2 turns per episode
    produced = producer.produce(request(3, rows, [1, 2, 3], seed=5))
    # The weights in the policy at each generate call: version 1, 2, 3 (10 v + 1).
    assert [c["weight"] for c in engine.calls] == [11.0, 21.0, 31.0]
    assert produced.call_versions == [1, 2, 3] and produced.step == 3
    got = [t.turn_versions for t in produced.result.trajectories]
    assert got == [[1], [1], [1, 2, 3], [1, 2, 3], [1, 2], [1, 2]]
    for t in produced.result.trajectories:  # every generated token's log-prob: its version's weight
        gen = [lp for lp, turn in zip(t.sampling_logps, t.action_turn) if turn >= 0]
        assert gen == [10.0 * v + 1.0 for v in t.token_versions() if v >= 0]
    assert sorted(producer.store) == [1, 2, 3]  # older than the first version (1): dropped
    assert producer.commands.poll(0.0)  # version 4 not read: no wait for what the batch does not need
    assert producer.loaded == 3 and torch.equal(producer.params["weight"].detach(), weights_of(3)["weight"])
    # The engine was synced once per version, after the version's weights were in the policy.
    assert engine.synced == [(11.0, 1), (21.0, 2), (31.0, 3)]
    assert {c["seed"] for c in engine.calls} == {call_seed(5, k) for k in range(3)}


def test_produce_drops_only_versions_older_than_the_requests_first():
    producer, _, engine = producer_with([0, 1, 2, 3])
    producer.load(3)  # everything received, version 3 in the model
    producer.produce(request(2, [0], [2]))  # one turn at version 2
    assert [c["weight"] for c in engine.calls] == [21.0]  # 3 was loaded: version 2 put back
    assert sorted(producer.store) == [2, 3]


def test_produce_waits_for_a_version_not_yet_published_and_counts_the_wait():
    producer, trainer, engine = producer_with([0])
    trainer.publish_weights(1, weights_of(1))  # sent 0.3 s later
    timer = threading.Timer(0.3, trainer.send_weights, args=(1,))
    timer.start()
    try:
        produced = producer.produce(request(1, [1], [0, 1]))  # turn 1 needs version 1: not yet there
    finally:
        timer.join()
    assert [c["weight"] for c in engine.calls] == [1.0, 11.0]
    assert produced.wait_s >= 0.25  # the wait for version 1
    assert 0.0 <= produced.work_s < produced.wait_s  # the generation alone
    assert producer.waited == 0.0  # the next batch counts its own waits


def draws(engine: FakeEngine) -> list[tuple[float, float, float]]:
    return [(c["torch"], c["python"], c["numpy"]) for c in engine.calls]


def draw_all() -> tuple[float, float, float]:
    return float(torch.rand(())), random.random(), float(np.random.rand())


def test_produce_with_a_seed_seeds_every_generator():
    producer, _, engine = producer_with([0])
    seed = batch_seed(3, 1, 7)
    producer.produce(request(7, [0], [0], seed=seed))
    torch.rand(5)  # whatever ran between batches
    random.random()
    producer.produce(request(7, [0], [0], seed=seed))
    producer.produce(request(8, [0], [0], seed=seed + 1))
    first, again, other = draws(engine)
    assert first == again and other != first
    torch.manual_seed(seed)
    expected = float(torch.rand(())), random.Random(seed).random(), np.random.RandomState(seed % 2**32).rand()
    assert first == expected


def test_produce_with_an_rng_state_continues_from_it_and_hands_it_back():
    producer, _, engine = producer_with([0])
    async_producer.seed_all(123)
    state = rng.capture()
    expected = [draw_all() for _ in range(3)]  # two turns: two calls, then what follows
    async_producer.seed_all(0)  # the producer's own state differs
    produced = producer.produce(request(0, [1], [0], rng_state=state))
    assert draws(engine) == expected[:2] and produced.rng_state is not None
    async_producer.seed_all(0)
    rng.restore(produced.rng_state)
    assert draw_all() == expected[2]
    seeded = producer.produce(request(1, [0], [0], seed=4))
    assert seeded.rng_state is None  # seeded batches hand nothing back


def test_receive_queues_requests_and_stops_on_stop():
    producer, trainer, _ = producer_with([0])
    driver = driver_of(trainer)
    driver.sampling, driver.group_size = SamplingParams(max_new_tokens=3), 2
    driver.request(2, [5, 4])
    trainer.send(("stop",))
    assert producer.receive() and producer.store.keys() == {0}
    assert torch.equal(load_file(producer.store[0])["weight"], weights_of(0)["weight"])  # a file
    assert producer.receive() and len(producer.pending) == 1
    req = producer.pending[0]
    assert (req.step, req.rows, req.versions, req.group_size) == (2, [5, 4], [0], 2)
    assert req.sampling.max_new_tokens == 3 and req.seed == batch_seed(0, 0, 2) and req.rng_state is None
    assert not (trainer.spool / "request-2.pkl").exists()  # read and removed
    with pytest.raises(Stop):
        producer.receive()
    trainer.send(("stop",))
    with pytest.raises(Stop):
        producer.load(1)  # told to stop while waiting for a version
    assert not producer.receive(wait=False)  # nothing there: no wait


def test_receive_stops_when_the_trainer_is_gone(monkeypatch):
    monkeypatch.setattr(async_producer, "POLL_S", 0.01)
    commands, _writer = pipe()
    orphan = Producer(build_parts, commands, parent_pid=-1)  # never this process's parent
    t0 = time.perf_counter()
    with pytest.raises(Stop):
        orphan.receive()
    assert time.perf_counter() - t0 < 5.0
    closed, writer = pipe()
    writer.close()  # the trainer's end closed (its process is gone): an end of file
    with pytest.raises(Stop):
        Producer(build_parts, closed, os.getppid()).receive()
    trainer, commands = trainer_side([])
    trainer.publish_weights(2, weights_of(2))
    producer = Producer(build_parts, commands, os.getppid())
    timer = threading.Timer(0.2, trainer.send_weights, args=(2,))
    timer.start()
    try:
        assert producer.receive()  # several empty polls, then the message
    finally:
        timer.join()
    assert producer.store.keys() == {2} and producer.waited >= 0.15


def test_newest_takes_the_newest_published_version_and_never_waits():
    producer, trainer, engine = producer_with([0, 1], max_staleness=2, partial=True)
    assert trainer.s.newest
    trainer.publish_weights(3, weights_of(3))  # published but the producer has not read it yet
    trainer.send_weights(3)
    req = Request(3, [2], [1], 1, SamplingParams(max_new_tokens=4), newest=True)
    produced = producer.produce(req)  # three turns
    assert produced.call_versions == [3, 3, 3]  # the newest there is (<= the step), read without waiting
    assert [c["weight"] for c in engine.calls] == [31.0] * 3
    producer2, trainer2, _engine2 = producer_with([1], max_staleness=2, partial=True)
    t0 = time.perf_counter()
    produced = producer2.produce(Request(3, [2], [1], 1, SamplingParams(max_new_tokens=4), newest=True))
    assert produced.call_versions == [1, 1, 1] and time.perf_counter() - t0 < 0.4  # no wait for 2 or 3
    again = producer2.produce(
        Request(3, [2], [1], 1, SamplingParams(max_new_tokens=4), newest=True, replay=[1, 1])
    )
    assert again.call_versions == [1, 1, 1]
    trainer2.publish_weights(2, weights_of(2))
    trainer2.send_weights(2)
    replayed = producer2.produce(
        Request(3, [2], [1], 1, SamplingParams(max_new_tokens=4), newest=True, replay=[1])
    )
    assert replayed.call_versions == [1, 2, 2]  # the first call as recorded, then the newest


def test_serve_builds_on_its_place_and_shuts_the_engine_down_at_the_end(tmp_path):
    built: list[FakeEngine] = []

    def build(place: Placement) -> tuple[Any, Any, Any]:
        parts = build_parts(place)
        built.append(parts[1])
        return parts

    commands, to_producer = pipe()
    from_producer, results = pipe()
    to_producer.send(("stop",))
    threads = torch.get_num_threads()
    try:
        code = async_producer.serve(
            build, commands, results, 1, os.getppid(), tmp_path, Placement("cpu", 1, 2)
        )
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    assert from_producer.recv(1.0) == ("ready", os.getpid()) and not from_producer.poll(0.0)
    assert built[0].place == Placement("cpu", 1, 2) and built[0].shut_down


# ---------------------------------------------------------------- checkpoint state
def test_state_dict_keeps_the_k_versions_before_the_step_and_load_puts_them_back():
    ar = driver_of(ProcessTransport(build_parts, AsyncSettings(max_staleness=2)), max_turns=2)
    for v in range(6):
        ar.publish(v, BatchSource(0, functools.partial(weights_of, v)))
    assert sorted(ar.transport.store) == [3, 4, 5]  # older than 5 - K: no request or checkpoint needs them
    assert sorted(p.name for p in ar.transport.spool.glob("weights-*")) == [
        f"weights-{v}.safetensors" for v in (3, 4, 5)
    ]
    ar.requested = {5: [0], 6: [1]}
    for step, call, version in ((5, 0, 3), (5, 1, 4), (7, 0, 9)):  # batch 5 is in flight with two
        ar.calls.started(step, call, version)  # calls started; 7 was taken
    state = ar.state_dict(5)
    assert sorted(state["versions"]) == [3, 4]  # version 5 is the checkpoint's own weights
    assert state["turns"] == {5: [3, 4]}
    fresh = driver_of(ProcessTransport(build_parts, AsyncSettings(max_staleness=2)), max_turns=2)
    fresh.load_state_dict(state)
    assert {v: float(w["weight"]) for v, w in fresh.restored.items()} == {3: 31.0, 4: 41.0}
    assert fresh.replay == {5: [3, 4]}
    fresh.load_state_dict({"versions": {"2": weights_of(2)}})  # keys as strings: still versions
    fresh.load_state_dict({})  # a checkpoint of a synchronous run
    assert sorted(fresh.restored) == [2, 3, 4]
    ar.close()
    assert not ar.transport.spool.exists() or not any(ar.transport.spool.iterdir())


def test_a_spool_left_by_a_killed_run_is_emptied_before_use(tmp_path):
    old = tmp_path / ".async" / "rank0"
    old.mkdir(parents=True)
    (old / "batch-3.pkl").write_bytes(b"not ours")
    ar = ProcessTransport(build_parts, AsyncSettings(max_staleness=1, spool_dir=str(tmp_path)))
    ar.publish_weights(0, weights_of(0))
    assert sorted(p.name for p in ar.spool.iterdir()) == ["weights-0.safetensors"]
    assert (ar.spool.stat().st_mode & 0o777) == 0o700  # private to the run's user
