"""Reward functions have a time limit like env steps (``reward.fn_timeout_s``): a call that
never returns is stopped, with what it started, and fails the run with an error naming the
limit, instead of hanging it (and a SIGTERM with it) for ever."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.rewards import FN_TIMEOUT_S, Episode, FunctionReward, build_reward
from rlhf_lightning.runtime.workers import close_shared_pools

EPISODES = [Episode("2+2?", ["4"], {"answer": "4"}), Episode("3+3?", ["six!"], {"answer": "6"})]


@pytest.fixture(autouse=True)
def no_shared_workers():
    close_shared_pools()
    yield
    close_shared_pools()


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2 :].split()[0] != "Z"


@pytest.mark.parametrize("name", ["hangs", "spins"])
def test_a_reward_function_past_its_limit_is_stopped_with_a_clear_error(name):
    reward = FunctionReward(f"tests.rewards.slow_rewards.{name}", timeout_s=1.0)
    # the shared worker is up and has imported the module: the limit below is the call's alone
    FunctionReward("tests.rewards.slow_rewards.lengths", timeout_s=30.0).score(EPISODES, "cpu")
    started = time.monotonic()
    with pytest.raises(RuntimeError) as raised:
        reward.score(EPISODES, "cpu")
    assert time.monotonic() - started < 1.0 + 10  # the limit, with room for a loaded machine
    message = str(raised.value)
    assert f"reward.fn=tests.rewards.slow_rewards.{name} (the reward function {name})" in message
    assert "did not return within 1 s (reward.fn_timeout_s) while scoring 2 completions" in message


def test_what_a_stopped_reward_function_started_is_killed_with_it(tmp_path):
    pid_file = tmp_path / "sleep.pid"
    episodes = [Episode("q", ["a"], {"pid_file": str(pid_file)})]
    with pytest.raises(RuntimeError, match="did not return within 2 s"):
        FunctionReward("tests.rewards.slow_rewards.hangs", timeout_s=2.0).score(episodes, "cpu")
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child), f"the reward function's `sleep 60` (pid {child}) outlived it"


def test_values_and_errors_come_back_from_the_worker():
    assert FunctionReward("tests.rewards.slow_rewards.lengths", timeout_s=30.0).score(EPISODES, "cpu") == [
        1.0,
        4.0,
    ]
    with pytest.raises(
        RuntimeError, match=r"\(the reward function raises\) raised ValueError: no judge today"
    ):
        FunctionReward("tests.rewards.slow_rewards.raises", timeout_s=30.0).score(EPISODES, "cpu")


def test_the_limit_is_configured_and_checked():
    from tests.conftest import compose_config

    cfg = compose_config(["reward=function", "reward.fn=tests.rewards.slow_rewards.lengths"])
    assert cfg.reward.fn_timeout_s == FN_TIMEOUT_S == 300.0  # on by default
    reward = build_reward(["function"], "tests.rewards.slow_rewards.lengths")
    assert reward is not None and reward.components[0].timeout_s == FN_TIMEOUT_S
    off = build_reward(["function"], "tests.rewards.slow_rewards.lengths", fn_timeout_s=None)
    assert off is not None and off.components[0].timeout_s is None
    with pytest.raises(ConfigError, match=r"reward\.fn_timeout_s.*a time limit > 0 seconds, or null"):
        build_reward(["function"], "tests.rewards.slow_rewards.lengths", fn_timeout_s=0)


def test_a_reward_function_that_cannot_be_pickled_is_refused_at_start_up_with_the_way_out():
    with pytest.raises(ConfigError, match=r"reward\.fn_timeout_s=null to call it in the trainer's process"):
        FunctionReward("tests.rewards.test_reward_timeout.NOT_PICKLABLE", timeout_s=5.0)


NOT_PICKLABLE = lambda prompts, completions, **kwargs: [0.0] * len(completions)  # noqa: E731


def test_a_run_with_a_hung_reward_function_fails_with_the_limit_named(tmp_path):
    from rlhf_lightning.run import run
    from tests.conftest import FAST, compose_config

    cfg = compose_config(
        [
            *FAST,
            "reward=function",
            "reward.fn=tests.rewards.slow_rewards.hangs",
            "reward.fn_timeout_s=2",
            "trainer.max_steps=2",
            "checkpoint.every_n_steps=0",
        ],
        output_dir=tmp_path / "run",
    )
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"did not return within 2 s \(reward\.fn_timeout_s\)"):
        run(cfg)
    assert time.monotonic() - started < 120
