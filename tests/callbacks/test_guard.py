"""The guard's collapse signals read the module's typed step summary (``StepSummary``), the
one place that maps logged metric names to what the guard and the population act on."""

from __future__ import annotations

from rlhf_lightning.callbacks.guard import collapse_signals
from rlhf_lightning.learner.records import StepSummary


def test_the_summary_reads_the_logged_names_and_leaves_missing_ones_none():
    s = StepSummary.from_metrics(
        {
            "rollout/reward_mean": 0.5,
            "rollout/reward_std": 0.1,
            "actor/grad_norm": 2.0,
            "critic/grad_norm": 1.0,
        }
    )
    assert (s.reward_mean, s.reward_std, s.grad_norm) == (0.5, 0.1, 2.0)
    assert s.empty_frac is None and s.loss is None and s.lr is None  # not logged (e.g. a warm-up step)


def test_each_signal_by_hand():
    signals = collapse_signals(empty_frac=0.9, floor=0.0)
    empty, zero, floor = signals.values()
    assert empty(StepSummary(empty_frac=0.95)) and not empty(StepSummary(empty_frac=0.5))
    assert zero(StepSummary(grad_norm=0.0)) and not zero(StepSummary(grad_norm=1e-9))
    assert floor(StepSummary(reward_mean=0.0, reward_std=0.0))
    assert not floor(StepSummary(reward_mean=0.5, reward_std=0.0))  # above the lowest mean seen
    assert not floor(StepSummary(reward_mean=0.0, reward_std=0.2))  # rewards still differ
    nothing = StepSummary()  # an offline step: no rollout metrics, nothing fires
    assert not any(fired(nothing) for fired in signals.values())
