"""Concurrent env steps: the same trajectories as one by one, per-step time limits, errors."""

from __future__ import annotations

import random
import time

import pytest

from rlhf_lightning.envs.chat import ChatFormatter
from rlhf_lightning.envs.harness import RolloutHarness
from rlhf_lightning.envs.stepping import EnvStepper, StepTimeout, call_with_timeout
from rlhf_lightning.rollout.engine import SamplingParams
from tests.envs.test_harness import ScriptedEngine


class SlowGuess:
    """A 3-turn env whose step sleeps a seeded, episode-specific time (so concurrent steps
    finish out of order) and whose reward depends on the episode and the turn."""

    def __init__(self, delay: float = 0.05) -> None:
        self.delay, self.turn, self.row = delay, 0, 0

    def reset(self, seed=None, *, row_index=None, evaluation=False):
        self.row, self.turn = int(row_index or 0), 0
        self.rng = random.Random(self.row)  # its own stream: concurrent envs share nothing
        return f"Round for row {self.row}", {}

    def step(self, action):
        time.sleep(self.delay * self.rng.random())
        self.turn += 1
        reward = (self.row % 5) / 10 + self.turn / 100 + len(action) / 1000
        return f"feedback {self.turn} for {self.row}", reward, self.turn >= 3, False, {"turn": self.turn}


class Hangs:
    def reset(self, seed=None, *, row_index=None, evaluation=False):
        self.row = int(row_index or 0)
        return "Q", {}

    def step(self, action):
        if self.row % 2:
            time.sleep(3.0)
        return "", 1.0, True, False, {}


def harness(tok, factory, **kw) -> RolloutHarness:
    return RolloutHarness(factory, tok, ChatFormatter(tok), max_turns=3, max_model_len=400, **kw)


def test_concurrent_steps_give_the_serial_trajectories(tiny_tokenizer):
    tok = tiny_tokenizer
    replies = [tok(t, add_special_tokens=False).input_ids + [tok.eos_token_id] for t in ("7", "12", "3")]
    rows = list(range(8))
    serial = harness(tok, SlowGuess).rollout(
        ScriptedEngine(replies), rows, SamplingParams(max_new_tokens=4), group_size=2
    )
    threaded = harness(tok, SlowGuess, concurrency=16).rollout(
        ScriptedEngine(replies), rows, SamplingParams(max_new_tokens=4), group_size=2
    )
    assert len(serial.trajectories) == len(threaded.trajectories) == 16
    for a, b in zip(serial.trajectories, threaded.trajectories):
        assert a.token_ids == b.token_ids and a.rewards == b.rewards and a.infos == b.infos
    assert serial.batch.input_ids.equal(threaded.batch.input_ids)
    assert serial.batch.rewards.equal(threaded.batch.rewards)


def test_a_step_past_its_time_limit_is_cut_and_scored_zero_or_raised(tiny_tokenizer):
    tok = tiny_tokenizer
    reply = [tok("1", add_special_tokens=False).input_ids + [tok.eos_token_id]]
    params = SamplingParams(max_new_tokens=4)
    zero = harness(tok, Hangs, concurrency=4, step_timeout_s=0.3, on_reward_error="zero")
    started = time.perf_counter()
    result = zero.rollout(ScriptedEngine(reply), [0, 1, 2, 3], params)
    assert time.perf_counter() - started < 2.5  # the hanging steps did not hold the batch
    assert [t.rewards for t in result.trajectories] == [[1.0], [0.0], [1.0], [0.0]]
    assert result.metrics["env/step_timeouts"] == 2 and result.metrics["env/reward_errors"] == 2
    raising = harness(tok, Hangs, step_timeout_s=0.3)
    with pytest.raises(
        RuntimeError, match=r"Hangs.step timed out: it did not return within 0.3 s \(env.step_timeout_s\)"
    ):
        raising.rollout(ScriptedEngine(reply), [0, 1], params)


def test_an_exception_in_a_concurrent_step_is_reported_like_a_serial_one(tiny_tokenizer):
    tok = tiny_tokenizer

    class Boom(Hangs):
        def step(self, action):
            raise KeyError("no such cell")

    h = harness(tok, Boom, concurrency=4)
    reply = [tok("1", add_special_tokens=False).input_ids + [tok.eos_token_id]]
    with pytest.raises(RuntimeError, match=r"(?s)Boom.step raised KeyError: 'no such cell'.*completion: '1'"):
        h.rollout(ScriptedEngine(reply), [0, 1, 2], SamplingParams(max_new_tokens=4))


def test_stepper_arguments_and_plain_calls():
    assert call_with_timeout(lambda: 3, None).output == 3
    assert isinstance(call_with_timeout(lambda: time.sleep(1), 0.05).error, StepTimeout)
    assert isinstance(call_with_timeout(lambda: 1 / 0, 1.0).error, ZeroDivisionError)
    with pytest.raises(ValueError, match=r"env\.concurrency must be at least 1"):
        EnvStepper(0)
    with pytest.raises(ValueError, match=r"env\.step_timeout_s must be > 0"):
        EnvStepper(2, 0.0)
