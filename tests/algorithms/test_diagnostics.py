"""Turn-level diagnostics, computed by hand on a small batch."""

from __future__ import annotations

import pytest
import torch

from rlhf_lightning.algorithms.diagnostics import MAX_TURN_METRICS, per_turn_means, turn_metrics


def test_turn_metrics_by_hand():
    # 3 episodes: 3 turns (env ended), 1 turn (truncated), 2 turns (env ended)
    turn_lengths = torch.tensor([[4, 2, 5], [8, 0, 0], [3, 3, 0]])
    rewards = torch.tensor([[0.0, -0.1, 1.0], [0.5, 0.0, 0.0], [0.2, 0.4, 0.0]])
    truncated = torch.tensor([False, True, False])
    m = turn_metrics(turn_lengths, rewards, truncated)
    assert float(m["rollout/env_ended_frac"]) == pytest.approx(2 / 3)
    assert float(m["rollout/reward_turn_0"]) == pytest.approx((0.0 + 0.5 + 0.2) / 3)
    assert float(m["rollout/reward_turn_1"]) == pytest.approx((-0.1 + 0.4) / 2)  # episodes that reached it
    assert float(m["rollout/reward_turn_2"]) == pytest.approx(1.0)
    assert "rollout/reward_turn_3" not in m


def test_per_turn_means_stop_at_the_cap_and_skip_unreached_turns():
    k = MAX_TURN_METRICS + 3
    values = torch.arange(2 * k, dtype=torch.float32).view(2, k)
    present = torch.ones(2, k, dtype=torch.bool)
    present[:, 1] = False
    m = per_turn_means(values, present, "critic/value_turn")
    assert sorted(m) == sorted(f"critic/value_turn_{i}" for i in range(MAX_TURN_METRICS) if i != 1)
    assert float(m["critic/value_turn_2"]) == pytest.approx((2 + (k + 2)) / 2)
