"""``guard.patience`` counts steps in a row; below 1 every step, healthy or not, reached it and
the guard warned of (or, with ``stop_on_collapse``, stopped on) a collapse at once. It is refused
at start-up (tests/config/test_startup_values.py) and by the guard itself."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rlhf_lightning.callbacks.guard import Guard
from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.learner.records import StepSummary

HEALTHY = StepSummary(reward_mean=0.5, reward_std=0.2, grad_norm=1.0, empty_frac=0.0)


@pytest.mark.parametrize("patience", [0, -1])
def test_a_patience_below_one_is_refused(tmp_path, patience):
    with pytest.raises(ConfigError, match=rf"guard\.patience={patience}: >= 1 steps in a row"):
        Guard(tmp_path, patience=patience)


def test_a_healthy_step_raises_no_collapse_with_patience_one(tmp_path, caplog):
    guard = Guard(tmp_path, patience=1, stop_on_collapse=True)
    trainer = SimpleNamespace(global_step=1, is_global_zero=True)
    guard.on_train_batch_end(trainer, SimpleNamespace(last_step=HEALTHY, nonfinite_streak=0))
    assert guard.stop_reason is None and not guard.warned
    assert set(guard.streaks.values()) == {0}
