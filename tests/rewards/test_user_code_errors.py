"""A failure of user code (here a reward function) ends the command line with that code's own
traceback and a last line naming what failed, not 60 lines of the trainer's frames between."""

from __future__ import annotations

import pytest

from tests.cli_zygote import run_cli
from tests.conftest import FAST
from tests.test_resume import command, env

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("timeout", ["300", "null"])  # in a worker process, and in the trainer's
def test_a_failing_reward_function_shows_its_traceback_and_a_clear_last_line(tmp_path, timeout):
    argv = command(
        *FAST,
        "reward=function",
        "reward.fn=tests.rewards.slow_rewards.raises",
        f"reward.fn_timeout_s={timeout}",
        "trainer.max_steps=1",
        f"output_dir={tmp_path / 'run'}",
    )
    done = run_cli(argv, cwd=tmp_path, env={**env(), "HYDRA_FULL_ERROR": "0"}, merged=True)
    out = done.stdout
    assert done.returncode == 1, out[-3000:]
    assert 'raise ValueError("no judge today")' in out  # the user's frame
    assert "slow_rewards.py" in out
    assert "lightning/pytorch" not in out and "rlhf_lightning/algorithms" not in out, out[-4000:]
    lines = [line for line in out.splitlines() if line.strip()]
    assert lines[-2].startswith(
        "error: reward.fn=tests.rewards.slow_rewards.raises (the reward function raises) raised "
        "ValueError: no judge today while scoring"
    ), lines[-5:]
    assert lines[-1] == "(HYDRA_FULL_ERROR=1 shows the trainer's frames too)"
