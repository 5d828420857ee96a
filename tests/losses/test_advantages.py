from __future__ import annotations

import statistics

import pytest
import torch

from rlhf_lightning.losses import ADVANTAGE_ESTIMATORS, get_advantage_estimator

REWARDS = [1.0, 0.0, 0.0, 1.0, 0.5, 2.0, 2.0, 3.0, -1.0]
GROUPS = [7, 7, 7, 7, 3, 3, 3, 9, 9]  # uneven group sizes, arbitrary labels


def by_group():
    groups: dict[int, list[int]] = {}
    for i, g in enumerate(GROUPS):
        groups.setdefault(g, []).append(i)
    return groups


def test_grpo_group_scale_matches_formula():
    expected = [0.0] * len(REWARDS)
    for idx in by_group().values():
        vals = [REWARDS[i] for i in idx]
        mu, sd = statistics.mean(vals), statistics.stdev(vals)
        for i in idx:
            expected[i] = (REWARDS[i] - mu) / (sd + 1e-6)
    got = get_advantage_estimator("grpo")(torch.tensor(REWARDS, dtype=torch.float64), torch.tensor(GROUPS))
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-10)


def test_dr_grpo_and_batch_scale():
    r, g = torch.tensor(REWARDS, dtype=torch.float64), torch.tensor(GROUPS)
    centred = [0.0] * len(REWARDS)
    for idx in by_group().values():
        mu = statistics.mean(REWARDS[i] for i in idx)
        for i in idx:
            centred[i] = REWARDS[i] - mu
    torch.testing.assert_close(
        get_advantage_estimator("dr_grpo")(r, g), torch.tensor(centred, dtype=torch.float64)
    )
    batch_sd = statistics.stdev(REWARDS)
    got = get_advantage_estimator("grpo")(r, g, scale="batch")
    torch.testing.assert_close(
        got, torch.tensor([c / (batch_sd + 1e-6) for c in centred], dtype=torch.float64)
    )


def test_rloo_leave_one_out_baseline():
    expected = []
    for i, g in enumerate(GROUPS):
        others = [REWARDS[j] for j in range(len(REWARDS)) if GROUPS[j] == g and j != i]
        expected.append(REWARDS[i] - sum(others) / len(others))
    got = get_advantage_estimator("rloo")(torch.tensor(REWARDS, dtype=torch.float64), torch.tensor(GROUPS))
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)


def test_constant_group_gets_zero_advantage_and_registry_names():
    got = get_advantage_estimator("grpo")(torch.ones(4), torch.zeros(4, dtype=torch.long))
    assert torch.all(got == 0)
    assert {"grpo", "dr_grpo", "rloo"} <= set(ADVANTAGE_ESTIMATORS)
    with pytest.raises(KeyError, match="valid names"):
        get_advantage_estimator("ppo")
