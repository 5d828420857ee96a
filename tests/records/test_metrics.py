"""episode_metrics by hand: what an info without a key counts as, and the episodes' shape."""

from __future__ import annotations

import pytest

from rlhf_lightning.records.metrics import episode_metrics
from rlhf_lightning.records.trajectory import Trajectory


def episode(infos, n_tokens=4, turns=1, truncated=False, cut=False):
    t = Trajectory([1] * n_tokens, [-1] * n_tokens, [0.0] * n_tokens, [0.0] * turns, 0, 1)
    t.infos, t.truncated, t.cut = infos, truncated, cut
    return t


def test_skip_averages_over_the_infos_that_carry_a_key_and_zero_over_episodes():
    trajs = [
        episode([{"valid": 1.0}, {"valid": 0.0, "correct": True}], n_tokens=6, turns=2, cut=True),
        episode([{"correct": False, "valid": 1.0}], n_tokens=4),
        episode([{"agent_error": True}], n_tokens=2, truncated=True),  # a failed episode: no numbers
    ]
    skip = episode_metrics(trajs)
    assert skip["env/correct"] == pytest.approx(1 / 2) and skip["env/valid"] == pytest.approx(2 / 3)
    assert skip["env/agent_error"] == 1.0
    zero = episode_metrics(trajs, missing="zero")
    assert zero["env/correct"] == pytest.approx(1 / 3) and zero["env/agent_error"] == pytest.approx(1 / 3)
    for m in (skip, zero):
        assert m["rollout/num_turns"] == pytest.approx(4 / 3)
        assert m["rollout/episode_tokens"] == pytest.approx(12 / 3)
        assert m["rollout/truncated_frac"] == pytest.approx(1 / 3)
        assert m["rollout/cut_frac"] == pytest.approx(1 / 3)


def test_strings_are_not_averaged_and_a_bad_mode_is_refused():
    assert "env/name" not in episode_metrics([episode([{"name": "x", "correct": 1}])])
    with pytest.raises(ValueError, match="skip or zero"):
        episode_metrics([], missing="mean")
