"""GDPO (``algo.advantage=gdpo``): each reward term normalised within its group before the
weighted sum, then the sum over the batch; checked by hand on a batch where it differs from
GRPO's sum-then-normalise, against an independent implementation, and through training."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from rlhf_lightning.algorithms.grpo import reward_terms
from rlhf_lightning.losses import ADVANTAGE_ESTIMATORS, get_advantage_estimator
from rlhf_lightning.records.trajectory import Trajectory, collate
from rlhf_lightning.rewards import CombinedReward, FunctionReward
from tests.conftest import FAST, compose_config, fit_steps


def short_reply(prompts, completions, **kwargs):
    """A second reward for the tests: 1 for a reply of at most 3 characters."""
    return [1.0 if len(c.strip()) <= 3 else 0.0 for c in completions]


def test_gdpo_by_hand_where_it_differs_from_sum_then_normalise():
    """Group A: correctness (1, 0, 0, 0) and format (0.5, 0.5, 0, 0); group B: correctness all 0,
    format (1, 0, 1, 0); weights 1 and 1.

    GRPO normalises the sums A: (1.5, 0.5, 0, 0) -> mean 0.5, std sqrt(0.5): rollout 2 gets
    exactly 0 although it beat rollouts 3 and 4 on format. GDPO normalises each reward in its
    group: correctness A (std 1/2) -> (1.5, -0.5, -0.5, -0.5); format A (std sqrt(1/12)) ->
    (s, s, -s, -s) with s = 0.25 / sqrt(1/12) = sqrt(3)/2; group B: correctness constant -> 0,
    format (std sqrt(1/3)) -> (s, -s, s, -s). Sums: A (1.5 + s, s - 0.5, -0.5 - s, -0.5 - s),
    B (s, -s, s, -s); then over the batch of 8: mean m and std d (n - 1)."""
    correct = [1, 0, 0, 0, 0, 0, 0, 0]
    fmt = [0.5, 0.5, 0, 0, 1, 0, 1, 0]
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    components = torch.tensor([correct, fmt], dtype=torch.float64).T  # (8, 2)
    eps = 1e-6
    hi, lo = 0.75 / (0.5 + eps), -0.25 / (0.5 + eps)  # correctness, group A
    sa, sb = 0.25 / (math.sqrt(1 / 12) + eps), 0.5 / (math.sqrt(1 / 3) + eps)  # format, groups A and B
    sums = [hi + sa, lo + sa, lo - sa, lo - sa, sb, -sb, sb, -sb]
    m = sum(sums) / 8
    d = math.sqrt(sum((x - m) ** 2 for x in sums) / 7)
    expected = torch.tensor([(x - m) / (d + eps) for x in sums], dtype=torch.float64)
    total = components.sum(-1)
    adv = get_advantage_estimator("gdpo")(
        total, groups, components=components, weights=torch.tensor([1.0, 1.0])
    )
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-12)
    grpo = get_advantage_estimator("grpo")(total, groups)
    assert grpo[1].item() == 0.0 and adv[1].item() > 0.1  # GDPO keeps rollout 2's format win
    assert adv[1].item() == pytest.approx(0.2743, abs=1e-4)  # (sa - 0.5 - m) / d: m = 0, d = 1.3344


def reference(components, groups, weights, eps):
    """The paper's formula in plain Python (statistics.stdev: n - 1)."""
    n, c = len(components), len(weights)
    total = [0.0] * n
    for k in range(c):
        for g in set(groups):
            idx = [i for i in range(n) if groups[i] == g]
            vals = [components[i][k] for i in idx]
            mean = statistics.fmean(vals)
            std = statistics.stdev(vals) if len(vals) > 1 else 0.0
            for i in idx:
                total[i] += weights[k] * (components[i][k] - mean) / (std + eps)
    mean, std = statistics.fmean(total), statistics.stdev(total)
    return [(x - mean) / (std + eps) for x in total]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gdpo_matches_an_independent_implementation(seed):
    g = torch.Generator().manual_seed(seed)
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2, 2, 5])  # unequal sizes, a singleton
    components = torch.randint(0, 3, (10, 3), generator=g).to(torch.float64) / 2
    weights = torch.tensor([1.0, 0.5, 2.0], dtype=torch.float64)
    adv = get_advantage_estimator("gdpo")(
        components @ weights, groups, components=components, weights=weights
    )
    expected = reference(components.tolist(), groups.tolist(), weights.tolist(), 1e-6)
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-10)


def test_gdpo_with_one_term_is_grpo_then_batch_normalised():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    grpo = get_advantage_estimator("grpo")(rewards, groups)
    expected = (grpo - grpo.mean()) / (grpo.std() + 1e-6)
    torch.testing.assert_close(get_advantage_estimator("gdpo")(rewards, groups), expected, rtol=0, atol=1e-12)
    assert ADVANTAGE_ESTIMATORS.meta("gdpo")["kind"] == "outcome"


def trajectory(reward: float, reply: str, group: int) -> Trajectory:
    return Trajectory(
        token_ids=[1, 2, 3],
        action_turn=[-1, 0, 0],
        sampling_logps=[0.0, -1.0, -1.0],
        rewards=[reward],
        group_id=group,
        prompt_len=1,
        replies=[reply],
        completion_text=reply,
        observation="q",
    )


def test_the_reward_group_hands_each_term_and_its_weight_to_the_batch():
    reward = CombinedReward(
        [FunctionReward(f"{__name__}.short_reply", None)], {"short_reply": 0.5}, use_env=True
    )
    trajs = [trajectory(1.0, "12", 0), trajectory(0.0, "12345", 0), trajectory(1.0, "123456", 0)]
    reward.apply(trajs)
    reward.finalize(trajs, lambda t: t)
    assert trajs[0].reward_terms == {"env": (1.0, 1.0), "short_reply": (0.5, 1.0)}
    batch = collate(trajs, 0)
    assert batch.reward_terms is not None and batch.reward_weights is not None
    assert batch.reward_terms.tolist() == [[1.0, 1.0], [0.0, 0.0], [1.0, 0.0]]
    assert batch.reward_weights.tolist() == [[1.0, 0.5]] * 3
    assert batch.select(torch.tensor([2])).reward_terms.tolist() == [[1.0, 0.0]]
    # the return is the weighted sum of the terms: no shaping term
    terms, weights = reward_terms(batch, batch.returns)
    assert weights.tolist() == [1.0, 0.5, 1.0] and terms[:, 2].tolist() == [0.0, 0.0, 0.0]
    # an overlong penalty (here -0.25 on row 1) added to the return is a term of its own
    terms, _ = reward_terms(batch, batch.returns - torch.tensor([0.0, 0.25, 0.0]))
    assert terms[:, 2].tolist() == [0.0, -0.25, 0.0]
    # without a reward group the return is the one term
    assert collate([trajectory(1.0, "1", 0)], 0).reward_terms is None


def test_training_with_gdpo_normalises_each_reward_term(tmp_path, monkeypatch):
    cfg = compose_config(
        [
            *FAST,
            "algo.advantage=gdpo",
            "reward=function",
            "reward.sources=[env,function]",
            f"reward.fn={__name__}.short_reply",
            "reward.weights={short_reply:0.5}",
            "reward.fn_timeout_s=null",
            "trainer.max_steps=1",
            "samples.every_n_steps=0",
        ],
        output_dir=tmp_path / "run",
    )
    seen = []
    original = ADVANTAGE_ESTIMATORS.get("gdpo")

    def spy(rewards, group_ids, **kwargs):
        out = original(rewards, group_ids, **kwargs)
        seen.append((rewards, group_ids, kwargs, out))
        return out

    monkeypatch.setitem(ADVANTAGE_ESTIMATORS._entries, "gdpo", spy)
    fit_steps(cfg, tmp_path, steps=1)
    assert len(seen) == 1
    rewards, groups, kwargs, adv = seen[0]
    components, weights = kwargs["components"], kwargs["weights"]
    assert components.shape == (16, 3) and weights.tolist() == [1.0, 0.5, 1.0]  # env, short_reply, shaping
    torch.testing.assert_close(
        (components * weights).sum(-1), rewards.to(components.dtype), rtol=0, atol=1e-6
    )
    expected = reference(components.tolist(), groups.tolist(), weights.tolist(), 1e-6)
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=adv.dtype), rtol=0, atol=1e-5)
