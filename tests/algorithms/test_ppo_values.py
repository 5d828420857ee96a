"""PPO's turn values and GAE bootstrap, through the module, against hand computations.

A stub critic returns a fixed value per token position, so every advantage below is worked
out by hand from the formulas (GAE, arXiv 1506.02438 eq. 16)."""

from __future__ import annotations

import pytest
import torch

from rlhf_lightning.algorithms.ppo import PPOModule
from rlhf_lightning.config import PPOConfig
from rlhf_lightning.learner.critic import reduce_to_steps, step_index
from rlhf_lightning.losses.advantages import gae_advantages
from rlhf_lightning.records.sampling import SamplingParams
from rlhf_lightning.records.trajectory import Trajectory, collate


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


def advantages(m: PPOModule, batch, rewards):
    """The family's advantages of ``batch`` for the module's one member."""
    return m.learner.family.advantages(m.learner, m.schedule.members[0], batch, rewards, rewards.sum(-1))


def trajectory(tokens, turns, rewards, finish, truncated, cut=None):
    lengths = [turns.count(k) for k in range(len(rewards))]
    return Trajectory(
        token_ids=tokens,
        action_turn=turns,
        sampling_logps=[0.0] * len(tokens),
        rewards=rewards,
        group_id=0,
        prompt_len=2,
        truncated=truncated,
        cut="length" in finish if cut is None else cut,
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
        adv = advantages(m, batch, rewards).tokens
        torch.testing.assert_close(adv[0, 1:3], torch.tensor([a0, a0]), atol=1e-6, rtol=0)
        torch.testing.assert_close(adv[1, 1:3], torch.tensor([a1, a1]), atol=1e-6, rtol=0)
    assert PPOConfig().turn_value_reduction == "state"


# How an episode ended -> (truncated, cut): terminal; stopped by max_turns / max_model_len / the
# env's truncation; its last reply cut at max_new_tokens before the env ended it.
ENDS = {"terminal": (False, False), "stopped": (True, False), "cut": (True, True)}


@pytest.mark.parametrize("bootstrap_cut", [False, True])
@pytest.mark.parametrize("ended", sorted(ENDS))
def test_single_turn_bootstraps_only_when_stopped_before_the_end(ended, bootstrap_cut):
    truncated, cut = ENDS[ended]
    finish = ["length" if cut else "stop"]
    batch = distinct_prefixes(
        collate([trajectory([5, 6, 7, 8], [-1, -1, 0, 0], [0.0], finish, truncated, cut)], 0)
    )
    table = torch.tensor([[0.0, 0.3, 0.8, 0.5, 9.0]])  # column 3: after the last token (bootstrap)
    m = module(table, gamma=1.0, gae_lambda=1.0, bootstrap_cut_replies=bootstrap_cut)
    rewards = batch.rewards.float()
    found = advantages(m, batch, rewards)
    adv = found.tokens
    boots = ended == "stopped" or (ended == "cut" and bootstrap_cut)
    want = 0.0 + (0.5 if boots else 0.0) - 0.3
    torch.testing.assert_close(adv[0, 1:3], torch.tensor([want, want]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("reward", [1.0, 0.0])
def test_a_cut_reply_the_env_scored_is_terminal(tiny_tokenizer, reward):
    """A reply cut at max_new_tokens that the env still scored and ended (terminated=True): its
    reward is the outcome, so the target is r, not r + V(s_T) (a cut reply scored 1 would get a
    target above the maximum return; a cut chain of thought scored 0 would lose its penalty)."""
    from rlhf_lightning.records.sampling import Completion
    from rlhf_lightning.rollout.episodes.harness import ChatFormatter, RolloutHarness

    class OneReply:
        def generate(self, prompts, params):
            return [Completion([7, 8], [-0.5, -0.5], "length", i) for i, _ in enumerate(prompts)]

    class Scored:
        def reset(self, seed=None, **kw):
            return "Q", {}

        def step(self, action):
            return "", reward, True, False, {}

    tok = tiny_tokenizer
    result = RolloutHarness(Scored, tok, ChatFormatter(tok)).rollout(
        OneReply(), [0], SamplingParams(max_new_tokens=2)
    )
    batch = distinct_prefixes(result.batch)
    assert bool(batch.cut[0]) and not bool(batch.truncated[0])
    p = int(batch.prompt_lens[0])  # columns p-1, p: the two action tokens; p + 1: after the last
    table = torch.zeros(1, p + 3)
    table[0, p - 1], table[0, p], table[0, p + 1] = 0.3, 0.6, 0.9
    m = module(table, gamma=1.0, gae_lambda=1.0, advantage_granularity="token")
    rewards = batch.rewards.float()
    found = advantages(m, batch, rewards)
    adv = found.tokens
    # token-level GAE with lambda = gamma = 1 and V_end = 0: A_t = r - V(s_t)
    torch.testing.assert_close(adv[0, p - 1 : p + 1], torch.tensor([reward - 0.3, reward - 0.6]))
    assert found.critic is not None
    targets = found.critic.returns[0, :2]  # the critic's targets: the return r itself
    torch.testing.assert_close(targets, torch.tensor([reward, reward]))


@pytest.mark.parametrize("bootstrap_cut", [False, True])
@pytest.mark.parametrize("ended", sorted(ENDS))
def test_two_turns_gae_by_hand(ended, bootstrap_cut):
    """turn 0: tokens 2-3, observation 4-5, turn 1: tokens 6-7. The episode ended in a terminal
    state, was stopped by max_turns, or its second reply was cut at max_new_tokens while the
    multi-turn env had not ended it: a cut is terminal unless bootstrap_cut_replies."""
    truncated, cut = ENDS[ended]
    tokens, turns = [5, 6, 7, 8, 9, 10, 11, 12], [-1, -1, 0, 0, -1, -1, 1, 1]
    t = trajectory(tokens, turns, [0.2, 1.0], ["stop", "length" if cut else "stop"], truncated, cut)
    batch = distinct_prefixes(collate([t], 0))
    v0, v1, vb = 0.4, 0.6, 0.9  # columns 1 (turn 0's state), 5 (turn 1's state), 7 (after the end)
    table = torch.tensor([[0.0, v0, 7.0, 0.0, 0.0, v1, 7.0, vb, 0.0]])
    gamma, lam = 0.9, 0.8
    m = module(table, gamma=gamma, gae_lambda=lam, bootstrap_cut_replies=bootstrap_cut)
    rewards = batch.rewards.float()
    found = advantages(m, batch, rewards)
    adv = found.tokens
    boot = vb if ended == "stopped" or (ended == "cut" and bootstrap_cut) else 0.0
    d1 = 1.0 + gamma * boot - v1
    d0 = 0.2 + gamma * v1 - v0
    a1, a0 = d1, d0 + gamma * lam * d1
    torch.testing.assert_close(adv[0, [1, 2]], torch.tensor([a0, a0]), atol=1e-6, rtol=0)
    torch.testing.assert_close(adv[0, [5, 6]], torch.tensor([a1, a1]), atol=1e-6, rtol=0)
    assert adv[0, [0, 3, 4]].abs().sum() == 0
    assert found.critic is not None  # the critic's target for turn 1 is r + gamma * V_after
    torch.testing.assert_close(found.critic.returns[0, 1], torch.tensor(1.0 + gamma * boot))


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


@pytest.mark.parametrize("granularity", ["token", "turn"])
def test_kl_in_reward_is_each_tokens_own_reward(granularity):
    """``kl_mode=reward``: every action token gets the reward ``-beta * kl_t`` (the task reward
    stays on the last one), so GAE at lambda < 1 credits a token with its own KL at full weight
    instead of 0.95^(distance to the end). Expected values by hand, in float64."""
    # one turn of 4 action tokens: token columns 1..4 of the (B, L-1) layout; 5 is after the end
    t = trajectory([5, 6, 7, 8, 9, 10], [-1, -1, 0, 0, 0, 0], [1.0], ["stop"], False)
    batch = distinct_prefixes(collate([t], 0))
    values = [0.1, 0.4, 0.2, 0.7]
    table = torch.tensor([[0.0, *values, 0.0]])
    old = torch.tensor([[0.0, -1.0, -2.0, -0.5, -1.5, 0.0]])[:, :5]
    ref = torch.tensor([[0.0, -1.2, -1.0, -0.5, -2.5, 0.0]])[:, :5]
    beta, gamma, lam = 0.1, 1.0, 0.95
    m = module(
        table, beta=beta, kl_mode="reward", kl_estimator="k1", kl_clamp=None, gamma=gamma, gae_lambda=lam,
        advantage_granularity=granularity,
    )  # fmt: skip
    adv = m.learner.score_with(batch, m.schedule.members[0], old, ref).adv
    kl_t = [o - r for o, r in zip(old[0, 1:].double().tolist(), ref[0, 1:].double().tolist())]  # k1
    if granularity == "token":
        r = [-beta * k for k in kl_t]
        r[-1] += 1.0
        v = values + [0.0]  # terminal: V after the end is 0
        deltas = [r[i] + gamma * v[i + 1] - v[i] for i in range(4)]
        want = [sum((gamma * lam) ** j * deltas[i + j] for j in range(4 - i)) for i in range(4)]
    else:  # one step: the turn's reward is the task reward plus the sum of its tokens' penalties
        a = 1.0 - beta * sum(kl_t) - values[0]
        want = [a] * 4
    torch.testing.assert_close(
        adv[0, 1:5].double(), torch.tensor(want, dtype=torch.float64), atol=1e-6, rtol=0
    )
