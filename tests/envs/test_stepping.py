"""Concurrent env steps: the same trajectories as one by one, per-step time limits that stop
the step (its worker process), errors, and nothing left running afterwards."""

from __future__ import annotations

import time

import pytest

from rlhf_lightning.records.sampling import SamplingParams
from rlhf_lightning.rollout.episodes.chat import ChatFormatter
from rlhf_lightning.rollout.episodes.harness import RolloutHarness
from rlhf_lightning.rollout.episodes.stepping import EnvStepper
from tests.envs.slow_things import Boom, Dies, Hangs, SlowGuess
from tests.envs.test_harness import ScriptedEngine
from tests.runtime.test_workers import assert_no_children, new_children, note_children


def harness(tok, factory, **kw) -> RolloutHarness:
    return RolloutHarness(factory, tok, ChatFormatter(tok), max_turns=3, max_model_len=400, **kw)


@pytest.fixture(autouse=True)
def _children_before():
    note_children()


@pytest.mark.parametrize("workers", ["process", "thread"])
def test_concurrent_steps_give_the_serial_trajectories(tiny_tokenizer, workers):
    tok = tiny_tokenizer
    replies = [tok(t, add_special_tokens=False).input_ids + [tok.eos_token_id] for t in ("7", "12", "3")]
    rows = list(range(8))
    serial = harness(tok, SlowGuess).rollout(
        ScriptedEngine(replies), rows, SamplingParams(max_new_tokens=4), group_size=2
    )
    concurrent = harness(tok, SlowGuess, concurrency=16, step_workers=workers)
    try:
        together = concurrent.rollout(
            ScriptedEngine(replies), rows, SamplingParams(max_new_tokens=4), group_size=2
        )
    finally:
        concurrent.close()
    assert len(serial.trajectories) == len(together.trajectories) == 16
    for a, b in zip(serial.trajectories, together.trajectories):
        assert a.token_ids == b.token_ids and a.rewards == b.rewards and a.infos == b.infos
    assert serial.batch.input_ids.equal(together.batch.input_ids)
    assert serial.batch.rewards.equal(together.batch.rewards)
    assert_no_children()


def test_a_step_past_its_time_limit_is_stopped_and_scored_zero_or_raised(tiny_tokenizer):
    tok = tiny_tokenizer
    reply = [tok("1", add_special_tokens=False).input_ids + [tok.eos_token_id]]
    params = SamplingParams(max_new_tokens=4)
    zero = harness(tok, Hangs, concurrency=4, step_timeout_s=0.3, on_reward_error="zero")
    zero.rollout(ScriptedEngine(reply), [0], params)  # the workers are up (a worker's start is not timed)
    started = time.perf_counter()
    result = zero.rollout(ScriptedEngine(reply), [0, 1, 2, 3], params)
    assert time.perf_counter() - started < 2.5  # the hanging steps did not hold the batch
    assert [t.rewards for t in result.trajectories] == [[1.0], [0.0], [1.0], [0.0]]
    assert result.metrics["env/step_timeouts"] == 2 and result.metrics["env/reward_errors"] == 2
    pool = zero.stepper._pool
    assert pool is not None and pool.timeouts == 2
    assert pool.started - len(new_children()) == 2  # the two stopped steps' workers are gone
    zero.close()
    assert_no_children()  # nothing of the stopped steps runs on
    raising = harness(tok, Hangs, step_timeout_s=0.3)
    with pytest.raises(
        RuntimeError, match=r"Hangs.step timed out: it did not return within 0.3 s \(env.step_timeout_s\)"
    ):
        raising.rollout(ScriptedEngine(reply), [0, 1], params)
    raising.close()


@pytest.mark.parametrize("workers", ["process", "thread"])
def test_an_exception_in_a_concurrent_step_is_reported_like_a_serial_one(tiny_tokenizer, workers):
    tok = tiny_tokenizer
    h = harness(tok, Boom, concurrency=4, step_workers=workers)
    reply = [tok("1", add_special_tokens=False).input_ids + [tok.eos_token_id]]
    with pytest.raises(RuntimeError, match=r"(?s)Boom.step raised KeyError: 'no such cell'.*completion: '1'"):
        h.rollout(ScriptedEngine(reply), [0, 1, 2], SamplingParams(max_new_tokens=4))
    h.close()


def test_a_step_whose_worker_dies_is_an_env_error(tiny_tokenizer):
    tok = tiny_tokenizer
    h = harness(tok, Dies, concurrency=2, on_reward_error="zero")
    reply = [tok("1", add_special_tokens=False).input_ids + [tok.eos_token_id]]
    result = h.rollout(ScriptedEngine(reply), [0, 1, 2], SamplingParams(max_new_tokens=4))
    assert [t.rewards for t in result.trajectories] == [[1.0], [0.0], [1.0]]
    assert result.metrics["env/reward_errors"] == 1 and "env/step_timeouts" not in result.metrics
    h.close()
    strict = harness(tok, Dies, concurrency=2)
    with pytest.raises(
        RuntimeError, match=r"Dies.step raised WorkerDied: the worker process exited with code 9"
    ):
        strict.rollout(ScriptedEngine(reply), [0, 1], SamplingParams(max_new_tokens=4))
    strict.close()


def test_an_env_that_cannot_be_pickled_names_the_fix(tiny_tokenizer):
    tok = tiny_tokenizer

    class Inner(Hangs):
        pass

    h = harness(tok, Inner, concurrency=2)
    reply = [tok("1", add_special_tokens=False).input_ids + [tok.eos_token_id]]
    with pytest.raises(TypeError, match=r"env\.step_workers=thread"):
        h.rollout(ScriptedEngine(reply), [0, 1], SamplingParams(max_new_tokens=4))
    h.close()


def test_stepper_arguments():
    with pytest.raises(ValueError, match=r"env\.concurrency must be at least 1"):
        EnvStepper(0)
    with pytest.raises(ValueError, match=r"env\.step_timeout_s must be > 0"):
        EnvStepper(2, 0.0)
    with pytest.raises(ValueError, match=r"env\.step_workers must be one of process, thread"):
        EnvStepper(2, None, "fork")
    with pytest.raises(
        ValueError, match=r"needs env\.step_workers=process: a step on a thread cannot be stopped"
    ):
        EnvStepper(2, 1.0, "thread")
    assert not EnvStepper(1).in_processes and EnvStepper(1, 1.0).in_processes
    assert EnvStepper(2).in_processes and not EnvStepper(2, None, "thread").in_processes


def test_a_step_worker_imports_no_torch():
    """A step worker process imports rollout.stepping (step_env) when it starts; torch there
    made each fresh worker, and each stopped step's replacement, ~2 s slower."""
    import subprocess
    import sys

    code = "import sys, rlhf_lightning.rollout.episodes.stepping; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
