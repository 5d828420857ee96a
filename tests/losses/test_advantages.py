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


def test_mean_only_is_dr_grpo():
    r, g = torch.tensor(REWARDS, dtype=torch.float64), torch.tensor(GROUPS)
    torch.testing.assert_close(
        get_advantage_estimator("mean_only")(r, g), get_advantage_estimator("dr_grpo")(r, g)
    )


def test_rebn_whitens_returns_over_the_batch():
    mu, sd = statistics.mean(REWARDS), statistics.stdev(REWARDS)
    got = get_advantage_estimator("rebn")(torch.tensor(REWARDS, dtype=torch.float64), torch.tensor(GROUPS))
    expected = [(r - mu) / (sd + 1e-6) for r in REWARDS]
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-10)


def test_reinforce_pp_group_baseline_then_global_whitening():
    centred = []
    for i, g in enumerate(GROUPS):
        members = [REWARDS[j] for j in range(len(REWARDS)) if GROUPS[j] == g]
        centred.append(REWARDS[i] - statistics.mean(members))
    mu, sd = statistics.mean(centred), statistics.stdev(centred)
    got = get_advantage_estimator("reinforce_pp")(
        torch.tensor(REWARDS, dtype=torch.float64), torch.tensor(GROUPS)
    )
    torch.testing.assert_close(
        got, torch.tensor([(c - mu) / (sd + 1e-6) for c in centred], dtype=torch.float64), rtol=0, atol=1e-10
    )


def test_gae_matches_hand_computed_multi_turn_example():
    """Two episodes: 3 turns (rewards on turns 1 and 3) and 2 turns; gamma=0.9, lambda=0.8."""
    gamma, lam = 0.9, 0.8
    rewards = torch.tensor([[0.0, 1.0, 2.0], [0.5, -1.0, 0.0]], dtype=torch.float64)
    values = torch.tensor([[0.3, 0.6, 1.5], [0.2, -0.4, 7.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    # Episode 1: deltas
    d12 = 2.0 - 1.5  # last turn: V(next) = 0
    d11 = 1.0 + gamma * 1.5 - 0.6
    d10 = 0.0 + gamma * 0.6 - 0.3
    a12 = d12
    a11 = d11 + gamma * lam * a12
    a10 = d10 + gamma * lam * a11
    # Episode 2 ends after 2 turns (the 7.0 is padding and must be ignored)
    d21 = -1.0 - (-0.4)
    d20 = 0.5 + gamma * (-0.4) - 0.2
    a21 = d21
    a20 = d20 + gamma * lam * a21
    adv, ret = get_advantage_estimator("gae")(rewards, values, mask, gamma=gamma, lam=lam)
    expected = torch.tensor([[a10, a11, a12], [a20, a21, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(ret, (expected + values) * mask, rtol=0, atol=1e-12)


def test_postprocess_and_informative_groups():
    from rlhf_lightning.losses.advantages import informative_groups, postprocess_advantages

    a = torch.tensor([3.0, -5.0, 0.5, 1.0], dtype=torch.float64)
    torch.testing.assert_close(
        postprocess_advantages(a, clip=1.0), torch.tensor([1.0, -1.0, 0.5, 1.0], dtype=torch.float64)
    )
    w = postprocess_advantages(a, whiten=True)
    assert abs(w.mean().item()) < 1e-12 and abs(w.std().item() - 1) < 1e-5
    info = informative_groups(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0]), torch.tensor([0, 0, 1, 1, 2, 2]))
    assert info.tolist() == [False, False, True, True, False, False]
