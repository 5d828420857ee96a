"""Per-turn bookkeeping: finish reasons, lengths and first action positions, and what derives
from them (truncation, the overlong penalty per turn)."""

from __future__ import annotations

import pytest
import torch

from rlhf_lightning.algorithms.base import RolloutModule
from rlhf_lightning.config import GRPOConfig
from rlhf_lightning.envs.arithmetic import ArithmeticEnv
from rlhf_lightning.envs.guess_number import GuessNumberEnv
from rlhf_lightning.learner.family import Family
from rlhf_lightning.losses.corrections import overlong_penalty
from rlhf_lightning.records.sampling import SamplingParams
from rlhf_lightning.records.trajectory import Trajectory, collate
from rlhf_lightning.rollout.episodes.harness import ChatFormatter, RolloutHarness
from tests.envs.test_harness import ScriptedEngine


def test_a_cut_reply_the_env_ends_is_cut_but_terminal(tiny_tokenizer):
    """The arithmetic env terminates on every reply, cut or not: the outcome is its reward, so
    the episode is terminal (``truncated`` False: no bootstrap) and only ``cut`` records it."""
    tok = tiny_tokenizer
    harness = RolloutHarness(lambda: ArithmeticEnv(), tok, ChatFormatter(tok))
    ids = tok("12", add_special_tokens=False).input_ids
    cut = harness.rollout(ScriptedEngine([ids], finish="length"), [0, 1], SamplingParams(max_new_tokens=2))
    assert cut.batch.cut.all() and cut.batch.turn_cut.all() and not cut.batch.truncated.any()
    assert cut.metrics["rollout/cut_frac"] == 1.0 and cut.metrics["rollout/truncated_frac"] == 0.0
    assert cut.trajectories[0].finish_reasons == ["length"]
    done = harness.rollout(
        ScriptedEngine([[*ids, tok.eos_token_id]]), [0, 1], SamplingParams(max_new_tokens=8)
    )
    assert not done.batch.truncated.any() and not done.batch.turn_cut.any() and not done.batch.cut.any()
    assert done.metrics["rollout/truncated_frac"] == 0.0 and done.metrics["rollout/cut_frac"] == 0.0


def test_a_cut_reply_mid_episode_is_cut_and_truncated(tiny_tokenizer):
    """A multi-turn env that has not ended when a reply is cut: the episode stops in a
    non-terminal state (``truncated``: PPO bootstraps it) and is ``cut``."""
    tok = tiny_tokenizer
    wrong = tok("99", add_special_tokens=False).input_ids  # never in [1, 20], so never terminal
    h = RolloutHarness(lambda: GuessNumberEnv(max_turns=10), tok, ChatFormatter(tok), max_turns=3)
    result = h.rollout(ScriptedEngine([wrong], finish="length"), [0], SamplingParams(max_new_tokens=2))
    t = result.trajectories[0]
    assert t.cut and t.truncated and t.num_turns == 1


def test_turn_lengths_and_starts_per_turn(tiny_tokenizer):
    tok = tiny_tokenizer
    wrong = tok("99", add_special_tokens=False).input_ids + [tok.eos_token_id]  # never in [1, 20]
    h = RolloutHarness(lambda: GuessNumberEnv(max_turns=10), tok, ChatFormatter(tok), max_turns=3)
    result = h.rollout(ScriptedEngine([wrong]), [0], SamplingParams(max_new_tokens=4))
    t, b = result.trajectories[0], result.batch
    assert t.truncated and t.finish_reasons == ["stop"] * 3  # cut by the turn limit, not by length
    assert b.turn_lengths[0].tolist() == [len(wrong)] * 3
    for k, start in enumerate(b.turn_starts[0].tolist()):
        # column `start` of the shifted layout predicts token start + 1: the turn's first token
        assert b.turn_ids[0, start] == k and (start == 0 or b.turn_ids[0, start - 1] != k)
        assert b.action_mask[0, start]


class Plain(Family):
    """The returns as advantages; the shaped per-turn rewards it saw kept."""

    def advantages(self, learner, member, traj, rewards, returns, kl_rewards=None):
        self.seen = rewards
        return returns


class PlainModule(RolloutModule):
    family = Plain


def _module(**hp) -> RolloutModule:
    cfg = GRPOConfig(**hp)
    return PlainModule(None, None, None, SamplingParams(max_new_tokens=128), cfg)  # type: ignore[arg-type]


def score(m: RolloutModule, batch):
    return m.learner.score_with(batch, m.schedule.members[0], None, None)


def test_overlong_penalty_applies_to_each_turn_from_its_own_length():
    # 3 turns of 100 tokens with a per-turn cap of 128 and a buffer of 32: each turn is within
    # max_len - buffer = 96 + 4 tokens, so each pays (96 - 100) / 32 = -0.125.
    turns = [k for k in range(3) for _ in range(100)]
    tokens = [1, 2] + [3] * 300
    t = Trajectory(
        token_ids=tokens,
        action_turn=[-1, -1, *turns],
        sampling_logps=[0.0] * len(tokens),
        rewards=[0.0, 0.0, 1.0],
        group_id=0,
        prompt_len=2,
        finish_reasons=["stop"] * 3,
        turn_lengths=[100, 100, 100],
    )
    batch = collate([t, t], pad_token_id=0)
    m = _module(overlong_buffer=32, overlong_penalty_factor=1.0)
    scored = score(m, batch)
    adv, metrics = scored.adv, scored.metrics
    torch.testing.assert_close(m.learner.family.seen[0], torch.tensor([-0.125, -0.125, 0.875]))
    torch.testing.assert_close(adv, torch.tensor([1.0 - 0.375, 1.0 - 0.375]))
    torch.testing.assert_close(metrics["rollout/overlong_penalty"], torch.tensor(-0.375))
    # the function itself, by hand
    got = overlong_penalty(torch.tensor([96, 100, 128, 140]), 128, 32, 2.0)
    torch.testing.assert_close(got, torch.tensor([0.0, -0.25, -2.0, -2.0]))


def test_mask_truncated_drops_cut_and_unfinished_episodes_from_the_loss():
    def traj(finish: str, truncated: bool) -> Trajectory:
        return Trajectory(
            token_ids=[1, 2, 3, 4],
            action_turn=[-1, -1, 0, 0],
            sampling_logps=[0.0] * 4,
            rewards=[1.0],
            group_id=0,
            prompt_len=2,
            truncated=truncated,
            cut=finish == "length",
            finish_reasons=[finish],
            turn_lengths=[2],
        )

    # cut and scored by the env; ended by the turn limit; finished
    batch = collate([traj("length", False), traj("stop", True), traj("stop", False)], pad_token_id=0)
    scored = score(_module(mask_truncated=True), batch)
    mask, metrics = scored.mask, scored.metrics
    assert not mask[0].any() and not mask[1].any() and mask[2].sum() == 2
    assert metrics["rollout/masked_truncated_frac"] == pytest.approx(2 / 3)


@pytest.mark.slow
def test_a_short_token_budget_shows_in_truncated_frac_and_the_mask(fast_cfg, tmp_path):
    from tests.conftest import fit_steps

    _, trainer = fit_steps(fast_cfg("rollout.max_new_tokens=2", "algo.mask_truncated=true"), tmp_path)
    m = trainer.callback_metrics
    # most 2-token replies of the tiny model are cut (a few are one digit + eos)
    assert m["rollout/cut_frac"] > 0.5
    assert m["rollout/truncated_frac"] == 0.0  # the arithmetic env scores (ends) every reply
    assert m["rollout/masked_truncated_frac"] == m["rollout/cut_frac"]
