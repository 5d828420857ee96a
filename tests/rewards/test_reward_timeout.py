"""Reward functions have a time limit like env steps (``reward.fn_timeout_s``): a call that
never returns is stopped, with what it started, and fails the run with an error naming the
limit, instead of hanging it (and a SIGTERM with it) for ever."""

from __future__ import annotations

import functools
import logging
import os
import pickle
import sys
import time
import types

import pytest

from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.rewards import FN_TIMEOUT_S, Episode, FunctionReward, build_reward
from rlhf_lightning.runtime.workers import close_shared_pools
from tests.rewards.copy_counting import CountsDeepCopies
from tests.runtime.test_workers import alive

EPISODES = [Episode("2+2?", ["4"], {"answer": "4"}), Episode("3+3?", ["six!"], {"answer": "6"})]


@pytest.fixture(autouse=True)
def no_shared_workers():
    close_shared_pools()
    yield
    close_shared_pools()


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


SEEN_PIDS: list[int] = []  # the processes notebook_reward ran in


@pytest.fixture
def main_function(monkeypatch):
    """A reward function as if defined in ``__main__`` (a script or notebook), picklable by that
    name in this process, which a worker process cannot import."""

    def notebook_reward(prompts, completions, **kwargs):
        SEEN_PIDS.append(os.getpid())
        return [float(len(c)) for c in completions]

    notebook_reward.__module__, notebook_reward.__qualname__ = "__main__", "notebook_reward"
    monkeypatch.setattr(sys.modules["__main__"], "notebook_reward", notebook_reward, raising=False)
    SEEN_PIDS.clear()
    return notebook_reward


def no_limit_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "WITHOUT a time limit" in r.getMessage()]


def test_a_function_defined_in_main_runs_in_process_with_one_warning(main_function, caplog):
    """It was sent to a worker, which cannot import ``__main__.notebook_reward``: every reward
    call failed. Now it runs here, unlimited, and one warning says how to get a limit."""
    pickle.loads(pickle.dumps(main_function))  # passes a pickle check in this process
    with caplog.at_level(logging.WARNING, logger="rlhf_lightning.rewards"):
        reward = FunctionReward("__main__.notebook_reward", timeout_s=5.0)
        assert [reward.score(EPISODES, "cpu") for _ in range(2)] == [[1.0, 4.0]] * 2
    assert reward.timeout_s is None and SEEN_PIDS.count(os.getpid()) == len(SEEN_PIDS) == 2
    (warning,) = no_limit_warnings(caplog)
    assert warning.startswith("reward.fn=__main__.notebook_reward is defined in (or refers to) __main__, ")
    assert "reward.fn_timeout_s=5 does not apply" in warning
    assert "define it in an importable module (a .py file on sys.path) and give its dotted path" in warning


def test_a_function_that_refers_to_main_or_an_in_memory_module_runs_in_process(
    main_function, monkeypatch, caplog
):
    ghost = types.ModuleType("ghost_rewards")  # made in memory: no file a worker could import
    ghost.lengths = lambda prompts, completions, **kw: [float(len(c)) for c in completions]
    ghost.lengths.__module__, ghost.lengths.__qualname__ = "ghost_rewards", "lengths"
    monkeypatch.setitem(sys.modules, "ghost_rewards", ghost)
    # importable itself, but it pickles a reference to __main__.notebook_reward
    monkeypatch.setattr(sys.modules[__name__], "WRAPS_MAIN", functools.partial(main_function), raising=False)
    with caplog.at_level(logging.WARNING, logger="rlhf_lightning.rewards"):
        for path, module in [
            ("ghost_rewards.lengths", "ghost_rewards"),
            (f"{__name__}.WRAPS_MAIN", "__main__"),
        ]:
            caplog.clear()
            reward = FunctionReward(path, timeout_s=5.0)
            assert reward.timeout_s is None
            assert reward.score(EPISODES, "cpu") == [1.0, 4.0]
            (warning,) = no_limit_warnings(caplog)
            assert f"reward.fn={path} is defined in (or refers to) {module}, " in warning
    # a module-level function of an importable module keeps its worker and its limit
    assert FunctionReward("tests.rewards.slow_rewards.lengths", timeout_s=5.0).timeout_s == 5.0
    assert FunctionReward("__main__.notebook_reward", timeout_s=None).timeout_s is None
    assert len(no_limit_warnings(caplog)) == 1  # null asked for no limit: nothing to warn about


def test_a_call_in_a_worker_does_not_deep_copy_its_arguments_before_pickling_them():
    """Pickling them for the worker copies them already; a call in this process copies them."""
    episodes = [Episode("q", ["ab"], {"text": CountsDeepCopies("one")}), Episode("q", ["c"], {"text": CountsDeepCopies("two")})]  # fmt: skip
    CountsDeepCopies.deepcopies = 0
    assert FunctionReward("tests.rewards.slow_rewards.lengths", timeout_s=30.0).score(episodes, "cpu") == [
        2.0,
        1.0,
    ]
    assert CountsDeepCopies.deepcopies == 0
    assert FunctionReward("tests.rewards.slow_rewards.lengths").score(episodes, "cpu") == [2.0, 1.0]
    assert CountsDeepCopies.deepcopies == 2
