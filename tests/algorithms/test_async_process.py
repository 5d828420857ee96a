"""The trainer side of asynchronous rollouts against a real spawned producer process, built from
the picklable fakes of ``test_async_units`` (the child imports that module by name): errors,
timeouts and exits are reported, a round trip and lockstep's RNG hand-over work, a producer
started again gets every version it needs.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import Any

import pytest
import torch

from rlhf_lightning.records.sampling import SamplingParams
from rlhf_lightning.rollout.asynchronous.driver import AsyncDriver
from rlhf_lightning.rollout.asynchronous.plan import AsyncSettings, BatchSource, Produced, batch_seed
from rlhf_lightning.rollout.asynchronous.process import ProcessTransport
from tests.algorithms.test_async_units import (
    build_exiting,
    build_failing,
    build_parts,
    build_sleeping,
    keep_global_rng,  # noqa: F401  (autouse)
    weights_of,
)


# ---------------------------------------------------------------- a real producer process
@pytest.fixture
def producers():
    """Drivers over the process transport under test; any producer still alive afterwards is
    terminated."""
    made: list[AsyncDriver] = []
    yield made
    procs = [ar.transport.proc for ar in made]
    for proc in [p for p in procs if p is not None and p.is_alive()]:
        proc.terminate()
        proc.join(timeout=5)


def rollouts(producers: list[AsyncDriver], build: Any, **settings: Any) -> AsyncDriver:
    s = AsyncSettings(**{"max_staleness": 1, "timeout_s": 120.0, **settings})
    ar = AsyncDriver(ProcessTransport(build, s), s, 2)
    producers.append(ar)
    return ar


def source_at(version: int) -> BatchSource:
    """The trainer's view at ``version``: its weights."""
    return BatchSource(0, lambda: weights_of(version))


def start(ar: AsyncDriver) -> None:
    """Start the producer process alone (no versions, no requests)."""
    ar.transport.start(BatchSource(0, dict), ar.calls)
    ar.started = True


def ask(ar: AsyncDriver, step: int, rows: list[int], sampling: SamplingParams, group_size: int) -> None:
    ar.sampling, ar.group_size = sampling, group_size
    ar.request(step, rows)


@pytest.mark.slow
def test_a_build_error_comes_back_with_its_traceback(producers):
    ar = rollouts(producers, build_failing)
    with pytest.raises(RuntimeError, match="the rollout producer failed") as err:
        start(ar)
    assert "Traceback" in str(err.value) and "ValueError: boom" in str(err.value)
    assert "build_failing" in str(err.value)  # where it failed


def test_a_silent_producer_times_out_naming_the_setting(producers):
    ar = rollouts(producers, build_sleeping, timeout_s=2.0)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"rollout\.async_timeout_s") as err:
        start(ar)
    assert time.monotonic() - t0 < 30
    assert f"pid {ar.transport.proc.pid}" in str(err.value) and "is alive" in str(err.value)


@pytest.mark.slow
def test_a_producer_that_exits_is_named_with_its_exit_code(producers):
    ar = rollouts(producers, build_exiting)
    with pytest.raises(RuntimeError, match="exited with code 3"):
        start(ar)


def rows_and_weights(produced: Produced) -> tuple[list[int], list[float]]:
    """The prompt row of each trajectory and the distinct weights its tokens were sampled with."""
    trajs = produced.result.trajectories
    logps = {lp for t in trajs for lp, turn in zip(t.sampling_logps, t.action_turn) if turn >= 0}
    return [t.token_ids[0] for t in trajs], sorted(logps)


@pytest.mark.slow
def test_round_trip_through_the_producer_process(producers):
    ar = rollouts(producers, build_parts)  # K = 1, two turns
    sampling = SamplingParams(max_new_tokens=4)
    ar.publish(0, source_at(0))
    start(ar)
    ask(ar, 0, [3, 0], sampling, 2)  # version 0
    ask(ar, 1, [1, 2], sampling, 2)  # version 0: the producer works ahead
    ar.publish(1, source_at(1))  # sent at once: the producer is running
    ask(ar, 2, [4, 5], sampling, 2)  # version 1
    p0 = ar.take(0, [3, 0])
    assert p0.step == 0 and p0.call_versions == [0, 0]
    assert [t.turn_versions for t in p0.result.trajectories] == [[0, 0], [0, 0], [0], [0]]
    assert rows_and_weights(p0) == ([3, 3, 0, 0], [1.0])  # version 0's weight, not the build's
    assert p0.rng_state is None and p0.work_s >= 0.0 and p0.wait_s >= 0.0
    torch.manual_seed(batch_seed(0, 0, 0))  # K >= 1: the batch's own seed, in the producer
    assert p0.result.trajectories[0].infos[0]["torch"] == float(torch.rand(()))
    p1 = ar.take(1, [1, 2])
    assert [t.turn_versions for t in p1.result.trajectories] == [[0, 0], [0, 0], [0], [0]]
    assert rows_and_weights(p1) == ([1, 1, 2, 2], [1.0])
    with pytest.raises(RuntimeError, match=r"step 2 with rows \[4, 5\].*step 2 with rows \[5, 4\]"):
        ar.take(2, [5, 4])  # batch 2 was made for other rows
    proc, pid = ar.transport.proc, ar.transport.proc.pid
    ar.close()
    assert ar.transport.proc is None and not proc.is_alive() and proc.exitcode == 0
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # joined: the OS process is gone


@pytest.mark.slow
def test_lockstep_hands_the_trainers_random_state_over_and_back(producers):
    ar = rollouts(producers, build_parts, max_staleness=0)
    sampling = SamplingParams(max_new_tokens=4)
    ar.publish(0, source_at(0))
    start(ar)
    with pytest.raises(RuntimeError, match="was not requested"):
        ar.take(0, [1])
    torch.manual_seed(11)
    state = torch.get_rng_state()
    ask(ar, 0, [1], sampling, 1)  # two turns: two draws, as in a synchronous rollout
    produced = ar.take(0, [1])
    after = float(torch.rand(()))
    torch.set_rng_state(state)
    expected = [float(torch.rand(())) for _ in range(2)]
    assert [info["torch"] for info in produced.result.trajectories[0].infos] == expected
    assert after == float(torch.rand(()))  # the trainer continues after the producer's draws
    ar.publish(1, source_at(1))
    ask(ar, 1, [0], sampling, 1)
    assert rows_and_weights(ar.take(1, [0])) == ([0], [11.0])  # K = 0: the current weights
    ar.close()


class OneRowEach:
    """Batch ``b`` trains row ``b``."""

    def rows(self, batch: int) -> list[int]:
        return [batch]


@pytest.mark.slow
def test_a_producer_started_again_is_sent_the_versions_it_needs(producers):
    ar = rollouts(producers, build_parts)  # K = 1
    sampling = SamplingParams(max_new_tokens=4)
    ar.begin(0, OneRowEach(), sampling, 1, source_at(0))  # fit 1: batches 0 and 1 at version 0
    assert rows_and_weights(ar.take(0, [0])) == ([0], [1.0])
    ar.updated(1, source_at(1))  # batch 2 at version 1
    ar.close()  # teardown at the end of the fit
    ar.begin(1, OneRowEach(), sampling, 1, source_at(1))  # fit 2 from step 1: batches 1 (version 0) and 2
    ar.s = replace(ar.s, timeout_s=3.0)  # the producer is up: fail fast if it never gets version 0
    assert rows_and_weights(ar.take(1, [1])) == ([1], [1.0])
    assert rows_and_weights(ar.take(2, [2])) == ([2], [11.0])
    ar.close()
