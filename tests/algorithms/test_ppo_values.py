"""PPO's turn values and GAE bootstrap, through the module, against hand computations.

A stub critic returns a fixed value per token position, so every advantage below is worked
out by hand from the formulas (GAE, arXiv 1506.02438 eq. 16)."""

from __future__ import annotations

import pytest
import torch

from rlhf_lightning.algorithms.critic import reduce_to_steps, step_index
from rlhf_lightning.algorithms.ppo import PPOModule
from rlhf_lightning.config import PPOConfig
from rlhf_lightning.envs.trajectory import Trajectory, collate
from rlhf_lightning.losses.advantages import gae_advantages
from rlhf_lightning.rollout.engine import SamplingParams


class StubCritic(torch.nn.Module):
    """``forward_heads(sub, ("value",))``: ``table[row, column]`` at the action columns."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.table = table
        self.w = torch.nn.Parameter(torch.zeros(()))

    def forward_heads(self, sub, heads, **kwargs):
        width = sub.action_mask.shape[1]
        rows = [int(r) for r in sub.prefix_ids]  # the tests give each row its own prefix id
        v = self.table[rows][:, :width]
        return {"value": v * sub.action_mask}

    def trainable_parameters(self, part="all"):
        return [self.w]


def module(table: torch.Tensor, **hp) -> PPOModule:
    cfg = PPOConfig(**{"advantage_granularity": "turn", "whiten_advantages": False, **hp})
    return PPOModule(StubCritic(table), None, None, SamplingParams(max_new_tokens=4), cfg)  # type: ignore[arg-type]


def trajectory(tokens, turns, rewards, finish, truncated):
    lengths = [turns.count(k) for k in range(len(rewards))]
    return Trajectory(
        token_ids=tokens,
        action_turn=turns,
        sampling_logps=[0.0] * len(tokens),
        rewards=rewards,
        group_id=0,
        prompt_len=2,
        truncated=truncated,
        finish_reasons=finish,
        turn_lengths=lengths,
    )


def distinct_prefixes(batch):
    batch.prefix_ids = torch.arange(len(batch))
    return batch


def test_perfect_critic_state_value_is_the_baseline():
    # One 2-token turn; the critic is perfect: V(s) = 0.3 before the turn, and once the first
    # token is out it already knows the return (1 or 0).
    t = [trajectory([5, 6, 7, 8], [-1, -1, 0, 0], [r], ["stop"], False) for r in (1.0, 0.0)]
    batch = distinct_prefixes(collate(t, pad_token_id=0))
    # columns of the (B, L-1) layout: 1 -> before token 2 (the state), 2 -> before token 3
    table = torch.tensor([[0.0, 0.3, 1.0, 9.0, 9.0], [0.0, 0.3, 0.0, 9.0, 9.0]])
    rewards = batch.rewards.float()
    expected = {"state": (0.7, -0.3), "mean": (0.35, -0.15), "final_value": (0.0, 0.0)}
    for reduction, (a0, a1) in expected.items():
        m = module(table, turn_value_reduction=reduction)
        adv = m.compute_advantages(batch, rewards, rewards.sum(-1))
        torch.testing.assert_close(adv[0, 1:3], torch.tensor([a0, a0]), atol=1e-6, rtol=0)
        torch.testing.assert_close(adv[1, 1:3], torch.tensor([a1, a1]), atol=1e-6, rtol=0)
    assert PPOConfig().turn_value_reduction == "state"


@pytest.mark.parametrize("truncated", [False, True])
def test_single_turn_bootstraps_only_when_truncated(truncated):
    finish = ["length" if truncated else "stop"]
    batch = distinct_prefixes(
        collate([trajectory([5, 6, 7, 8], [-1, -1, 0, 0], [0.0], finish, truncated)], 0)
    )
    table = torch.tensor([[0.0, 0.3, 0.8, 0.5, 9.0]])  # column 3: after the last token (bootstrap)
    m = module(table, gamma=1.0, gae_lambda=1.0)
    rewards = batch.rewards.float()
    adv = m.compute_advantages(batch, rewards, rewards.sum(-1))
    want = 0.0 + (0.5 if truncated else 0.0) - 0.3
    torch.testing.assert_close(adv[0, 1:3], torch.tensor([want, want]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("truncated", [False, True])
def test_two_turns_gae_by_hand(truncated):
    # turn 0: tokens 2-3, observation 4-5, turn 1: tokens 6-7; cut by max_turns when truncated
    tokens, turns = [5, 6, 7, 8, 9, 10, 11, 12], [-1, -1, 0, 0, -1, -1, 1, 1]
    t = trajectory(tokens, turns, [0.2, 1.0], ["stop", "stop"], truncated)
    batch = distinct_prefixes(collate([t], 0))
    v0, v1, vb = 0.4, 0.6, 0.9  # columns 1 (turn 0's state), 5 (turn 1's state), 7 (after the end)
    table = torch.tensor([[0.0, v0, 7.0, 0.0, 0.0, v1, 7.0, vb, 0.0]])
    gamma, lam = 0.9, 0.8
    m = module(table, gamma=gamma, gae_lambda=lam)
    rewards = batch.rewards.float()
    adv = m.compute_advantages(batch, rewards, rewards.sum(-1))
    boot = vb if truncated else 0.0
    d1 = 1.0 + gamma * boot - v1
    d0 = 0.2 + gamma * v1 - v0
    a1, a0 = d1, d0 + gamma * lam * d1
    torch.testing.assert_close(adv[0, [1, 2]], torch.tensor([a0, a0]), atol=1e-6, rtol=0)
    torch.testing.assert_close(adv[0, [5, 6]], torch.tensor([a1, a1]), atol=1e-6, rtol=0)
    assert adv[0, [0, 3, 4]].abs().sum() == 0


def test_reduce_to_steps_state_reads_the_first_token():
    turns = torch.tensor([[-1, 0, 0, -1, 1, 1, 1], [-1, -1, 0, 0, 0, -1, -1]])
    v = torch.tensor([[9.0, 1.0, 3.0, 9.0, 2.0, 4.0, 6.0], [9.0, 9.0, 5.0, 7.0, 0.0, 9.0, 9.0]])
    idx, s = step_index(turns >= 0, turns, "turn")
    assert reduce_to_steps(v, idx, s, "state").tolist() == [[1.0, 2.0], [5.0, 0.0]]


def test_gae_bootstrap_only_at_each_rows_last_step():
    rewards = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.2, 0.0], [0.1, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    boot = torch.tensor([2.0, 3.0], dtype=torch.float64)
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.5, lam=1.0, bootstrap=boot)
    # row 0: d1 = 1 + 0.5 * 2 - 0.2 = 1.8, d0 = 0 + 0.5 * 0.2 - 0.5 = -0.4, A0 = -0.4 + 0.5 * 1.8
    # row 1: d0 = 1 + 0.5 * 3 - 0.1 = 2.4
    want = torch.tensor([[0.5, 1.8, 0.0], [2.4, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(adv, want, atol=1e-12, rtol=0)
    torch.testing.assert_close(ret, (want + values) * mask, atol=1e-12, rtol=0)
