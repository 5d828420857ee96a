"""What train.py hands a sweeper: optimized_metric's final or best value, and an early, clear
error for a metric the run never logs."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf_lightning.callbacks.objective import optimized_value
from rlhf_lightning.config.errors import ConfigError

CSV = """step,rollout/reward_mean,eval/accuracy_sampled,train/loss
0,,0.20,
1,0.1,,0.5
2,0.3,0.50,0.4
3,0.2,,0.6
4,,0.40,
"""


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    (tmp_path / "metrics.csv").write_text(CSV)
    return tmp_path


def test_final_and_best_values_read_back_from_metrics_csv(run_dir):
    assert optimized_value(run_dir, "eval/accuracy_sampled") == 0.40
    assert optimized_value(run_dir, "eval/accuracy_sampled", "best", "maximize") == 0.50
    assert optimized_value(run_dir, "train/loss", "best", "minimize") == 0.4
    assert optimized_value(run_dir, "rollout/reward_mean", "final") == 0.2


def test_a_metric_never_logged_names_the_ones_that_were(run_dir):
    with pytest.raises(
        ConfigError, match=r"optimized_metric='eval/never'.*eval/accuracy_sampled.*train/loss"
    ):
        optimized_value(run_dir, "eval/never")
