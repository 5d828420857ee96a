"""GiGPO (``algo.advantage=gigpo``, arXiv 2505.10978): the episode-level group advantage plus a
step-level one among the turns of a group that started from the same state. Checked by hand and
against an independent float64 reference (plain Python) on a small batch with repeated states,
its reduction to GRPO on single-turn episodes, the turn state ids that collation records, the
config binding and refusals, and two training steps of CISPO on a multi-turn env."""

from __future__ import annotations

import hashlib
import math
import statistics
import struct
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from rlhf_lightning.algorithms.grpo import estimator
from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.losses import ADVANTAGE_ESTIMATORS, get_advantage_estimator
from rlhf_lightning.losses.step_advantages import (
    anchor_state_groups,
    shared_anchor_fraction,
    turn_advantages_to_tokens,
    turn_mask,
)
from rlhf_lightning.records.trajectory import Trajectory, collate, text_hash, token_hash
from rlhf_lightning.run.validation import validate
from tests.conftest import compose_config, fit_steps

EPS = 1e-6


def reference(rewards, groups, states, *, gamma, omega, scale="group"):
    """GiGPO per turn, written from the paper with lists and ``statistics`` (float64)."""

    def relative(values: list[float]) -> list[float]:
        if len(values) < 2:
            return [0.0 for _ in values]
        mean = statistics.fmean(values)
        div = statistics.stdev(values) + EPS if scale == "group" else 1.0
        return [(v - mean) / div for v in values]

    episode: dict[int, float] = {}
    for g in set(groups):
        members = [i for i, gi in enumerate(groups) if gi == g]
        for i, a in zip(members, relative([sum(rewards[i]) for i in members])):
            episode[i] = a
    step_return = {}
    for i, rs in enumerate(rewards):
        for k in range(len(rs)):
            step_return[i, k] = sum(gamma**j * r for j, r in enumerate(rs[k:]))
    step: dict[tuple[int, int], float] = {}
    anchors: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for i, ss in enumerate(states):
        for k, s in enumerate(ss):
            anchors.setdefault((groups[i], s), []).append((i, k))
    for steps in anchors.values():
        for ik, a in zip(steps, relative([step_return[ik] for ik in steps])):
            step[ik] = a
    return [[episode[i] + omega * step[i, k] for k in range(len(rs))] for i, rs in enumerate(rewards)]


def padded(rows, pad, dtype=torch.float64):
    width = max(len(r) for r in rows)
    return torch.tensor([list(r) + [pad] * (width - len(r)) for r in rows], dtype=dtype)


# Two groups of three episodes. Group 0 starts at state 10; two episodes then reach state 11
# (an anchor group of 2), one of them state 12, the other 13 (singletons), the third state 14.
# Group 1 starts at 20; two episodes reach state 11 too (the same id as group 0's: it must not
# join group 0's anchor group), the third stops after one turn.
GROUPS = [0, 0, 0, 7, 7, 7]
STATES = [[10, 11, 12], [10, 11, 13], [10, 14], [20, 11], [20, 11], [20]]
REWARDS = [[0.0, 0.5, 1.0], [0.0, 0.0, 0.0], [0.5, -0.1], [1.0, 0.0], [0.0, 1.0], [0.2]]


def gigpo(rewards, groups, states, **kwargs):
    return get_advantage_estimator("gigpo")(
        padded(rewards, 0.0),
        torch.tensor(groups),
        state_ids=padded(states, -1, torch.long),
        num_turns=torch.tensor([len(r) for r in rewards]),
        **kwargs,
    )


@pytest.mark.parametrize("scale", ["group", "none"])
def test_gigpo_on_a_batch_with_repeated_states_matches_the_reference(scale):
    got = gigpo(REWARDS, GROUPS, STATES, gamma=0.9, step_weight=0.7, scale=scale)
    expected = padded(reference(REWARDS, GROUPS, STATES, gamma=0.9, omega=0.7, scale=scale), 0.0)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_gigpo_by_hand():
    """omega = 1, gamma = 0.5, group std. Group 1: returns 1, 1, 0.2 -> mean 11/15, deviations
    (4/15, 4/15, -8/15), std sqrt((16 + 16 + 64) / 225 / 2) = sqrt(48) / 15: A^E = (4/sqrt(48),
    4/sqrt(48), -8/sqrt(48)) up to eps. Its turn 0 (state 20, all three): returns from turn 0
    1 + 0.5 * 0 = 1, 0 + 0.5 * 1 = 0.5, 0.2 -> mean 17/30, deviations (13, -2, -11)/30, std
    sqrt((169 + 4 + 121) / 900 / 2) = sqrt(147) / 30 -> A^S = (13, -2, -11) / sqrt(147). Turn 1
    (state 11, episodes 3 and 4; group 0's state 11 is another anchor group): returns 0 and 1 ->
    -/+ 1 / sqrt(2). Group 0's episode 2, turn 1 (state 14, alone): A^S = 0."""
    got = gigpo(REWARDS, GROUPS, STATES, gamma=0.5, step_weight=1.0)
    a_e = torch.tensor([4.0, 4.0, -8.0], dtype=torch.float64) / (math.sqrt(48) / 15 + EPS) / 15
    a_s0 = torch.tensor([13.0, -2.0, -11.0], dtype=torch.float64) / 30 / (math.sqrt(147) / 30 + EPS)
    a_s1 = torch.tensor([-0.5, 0.5], dtype=torch.float64) / (math.sqrt(0.5) + EPS)
    torch.testing.assert_close(got[3:, 0], a_e + a_s0, rtol=0, atol=1e-12)
    torch.testing.assert_close(got[3:5, 1], a_e[:2] + a_s1, rtol=0, atol=1e-12)
    # episode 2's second turn: its episode's advantage alone; after each episode's end: 0
    group0 = [sum(r) for r in REWARDS[:3]]
    alone = (group0[2] - statistics.fmean(group0)) / (statistics.stdev(group0) + EPS)
    torch.testing.assert_close(got[2, 1], torch.tensor(alone, dtype=torch.float64), rtol=0, atol=1e-12)
    assert got[2, 2] == 0 and got[3:, 2].eq(0).all() and got[5, 1] == 0


def test_the_anchor_groups_stay_inside_their_episode_group():
    mask = turn_mask(torch.tensor([3, 3, 2, 2, 2, 1]), 3)
    labels = anchor_state_groups(torch.tensor(GROUPS), padded(STATES, -1, torch.long), mask)
    assert labels[0, 1] == labels[1, 1] and labels[3, 1] == labels[4, 1]  # state 11 in each group
    assert labels[0, 1] != labels[3, 1]  # ... but not across groups
    assert labels[2, 2] == -1 and labels[5, 1:].eq(-1).all()  # turns not played
    assert len(set(labels[labels >= 0].tolist())) == 7  # group 0: 10, 11, 12, 13, 14; group 7: 20, 11
    # later turns: 11, 11, 12, 13, 14 (group 0), 11, 11 (group 1): 4 of 7 share their anchor group
    torch.testing.assert_close(shared_anchor_fraction(labels), torch.tensor(4 / 7))


def test_gigpo_reduces_to_grpo_times_one_plus_omega_on_single_turn_episodes():
    """One turn: every episode of a group starts from the group's prompt, so the anchor group
    is the episode group and R_0 = R: A = (1 + omega) * (R - mean) / (std + eps)."""
    returns = [[1.0, 0.0, 0.0, 0.5], [0.2, 0.2, 0.9, 0.0]]
    trajs = []
    for g, rs in enumerate(returns):
        prompt = [5 + g, 6, 7]
        for i, r in enumerate(rs):
            reply = [30 + i] * (i + 1)
            trajs.append(
                Trajectory(prompt + reply, [-1] * 3 + [0] * len(reply), [0.0] * (3 + i + 1), [r], g, 3)
            )
    batch = collate(trajs, pad_token_id=0)
    assert batch.state_ids.shape == (8, 1)
    assert batch.state_ids[:4].unique().numel() == 1 and batch.state_ids[4:].unique().numel() == 1
    got = get_advantage_estimator("gigpo")(
        batch.rewards.double(),
        batch.group_ids,
        state_ids=batch.state_ids,
        num_turns=batch.num_turns,
        step_weight=0.5,
    )
    stored = [[float(torch.tensor(r, dtype=torch.float32)) for r in rs] for rs in returns]  # as collated
    expected = [1.5 * (r - statistics.fmean(rs)) / (statistics.stdev(rs) + EPS) for rs in stored for r in rs]
    torch.testing.assert_close(got[:, 0], torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)


def test_turn_advantages_reach_every_token_of_their_turn_and_nothing_else():
    adv = torch.tensor([[1.0, -2.0, 3.0], [0.5, 0.0, 0.0]])
    turn_ids = torch.tensor([[-1, 0, 0, -1, 1, -1, 2, 2], [-1, -1, 0, 0, 0, -1, -1, -1]])
    got = turn_advantages_to_tokens(adv, turn_ids)
    expected = torch.tensor([[0, 1, 1, 0, -2, 0, 3, 3], [0, 0, 0.5, 0.5, 0.5, 0, 0, 0]])
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


# ------------------------------------------------------------------ the state ids of collation
def episode(prompt, turns, *, segmented=False):
    """A trajectory from the prompt and per turn (reply ids, the observation ids after it)."""
    ids, action, starts = list(prompt), [-1] * len(prompt), [0]
    for k, (reply, obs) in enumerate(turns):
        ids += reply
        action += [k] * len(reply)
        if obs and segmented:
            starts.append(len(ids))
        ids += obs
        action += [-1] * len(obs)
    return Trajectory(
        ids, action, [0.0] * len(ids), [0.0] * len(turns), 0, len(prompt), segment_starts=starts
    )


def test_token_hash_is_blake2b_of_the_int64_tokens():
    digest = hashlib.blake2b(struct.pack("<3q", 1, 2, 3), digest_size=8).digest()
    assert token_hash([1, 2, 3]) == int.from_bytes(digest, "little") >> 1 >= 0


def test_a_turns_state_is_the_tokens_given_to_the_model_before_its_reply():
    """``env.history=full``: the state of turn k > 0 is the observation after turn k - 1 (its
    feedback counts); turn 0's is the prompt. Equal observations after different replies give
    equal states; a shorter episode is padded with -1."""
    prompt = [1, 2, 3]
    a = episode(prompt, [([9, 9], [4, 5]), ([8], [6]), ([7], [])])
    b = episode(prompt, [([8], [4, 5]), ([9, 9, 9], [6, 6]), ([7], [])])
    c = episode(prompt, [([9, 9], [4, 6]), ([8], [])])
    batch = collate([a, b, c], pad_token_id=0)
    s = batch.state_ids
    assert s.shape == (3, 3)
    assert s[:, 0].tolist() == [token_hash(prompt)] * 3
    assert s[0, 1] == s[1, 1] == token_hash([4, 5]) and s[2, 1] == token_hash([4, 6])
    assert s[0, 2] == token_hash([6]) and s[1, 2] == token_hash([6, 6]) and s[2, 2] == -1


def test_with_history_last_a_turns_state_is_its_fresh_prompt():
    """``env.history=last``: each turn's prompt starts a new sequence (instructions + the latest
    observation); its state is that whole prompt."""
    t = episode([1, 2, 3], [([9], [1, 2, 4, 5]), ([8], [])], segmented=True)
    assert t.segment_starts == [0, 4]
    assert t.turn_state_ids() == [token_hash([1, 2, 3]), token_hash([1, 2, 4, 5])]


def test_a_state_the_env_names_wins_over_the_tokens():
    """``info["anchor_state"]`` (reset info for turn 0, the step's info for the turn after it):
    different feedback tokens, one named state; a turn whose info names none falls back to tokens."""
    a = episode([1, 2, 3], [([9], [4, 5]), ([8], [6]), ([7], [])])
    b = episode([1, 2, 3], [([9], [4, 6]), ([8], [6]), ([7], [])])
    for t, named in ((a, "board B"), (b, "board B")):
        t.task_info, t.infos = {"anchor_state": "board A"}, [{"anchor_state": named}, {}, {}]
    assert a.turn_state_ids()[:2] == b.turn_state_ids()[:2] == [text_hash("board A"), text_hash("board B")]
    assert a.turn_state_ids()[2] == b.turn_state_ids()[2] == token_hash([6])
    assert text_hash("x") != token_hash([ord("x")])


def test_gem_names_the_board_as_the_state_whatever_the_feedback():
    """GEM's Sudoku: two different rejected moves leave the board as it was; the feedback differs
    (it names the move), the anchor state is the board, the same as at reset."""
    pytest.importorskip("gem", reason="env=gem needs the gem extra")
    from rlhf_lightning.envs.gem import GemEnv

    states, feedback = [], []
    for move in ("\\boxed{1 1 9}", "\\boxed{2 2 9}"):  # 9 is out of range on a 4x4 board
        env = GemEnv("game:Sudoku-v0-easy", train_size=10, eval_size=2)
        obs0, info0 = env.reset(row_index=3)
        obs, _, _, _, info = env.step(move)
        assert info0["anchor_state"] == info0["suffix"] and info0["suffix"] in obs0
        states.append((info0["anchor_state"], info["anchor_state"]))
        feedback.append(obs)
    assert states[0] == states[1] and states[0][0] == states[0][1]
    assert feedback[0] != feedback[1]


def test_a_turn_without_generated_tokens_has_no_state():
    t = Trajectory([1, 2, 3], [-1, -1, -1], [0.0] * 3, [1.0], 0, 3)  # an agent episode with no call
    assert t.turn_state_ids() == [-1]


# ------------------------------------------------------------------------------------- config
MULTI_TURN = ["experiment=guess_number", "algo.prompts_per_step=4", "algo.group_size=4"]


@pytest.mark.parametrize("algo", ["grpo", "cispo", "gspo"])
def test_gigpo_binds_with_every_group_preset(algo):
    node = ["algo.advantage.name=gigpo", "+algo.advantage.step_weight=0.5", "+algo.advantage.gamma=0.9"]
    cfg = compose_config([*MULTI_TURN, f"algo={algo}", *node], Path("/tmp/unused"))
    validate(cfg)
    hp = OmegaConf.to_object(cfg.algo)
    fn, kwargs = estimator(hp)
    assert fn is get_advantage_estimator("gigpo") and ADVANTAGE_ESTIMATORS.meta("gigpo")["per_turn"]
    assert kwargs == {"scale": "group", "step_weight": 0.5, "gamma": 0.9}
    plain = compose_config([*MULTI_TURN, f"algo={algo}", "algo.advantage=gigpo"], Path("/tmp/unused"))
    validate(plain)
    assert estimator(OmegaConf.to_object(plain.algo))[1] == {"scale": "group"}


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("algo.advantage_scale=batch", r"algo\.advantage_scale='batch'.*one of group, none"),
        ("algo.whiten_advantages=true", r"algo\.whiten_advantages=True.*per turn"),
        ("algo.use_liger_loss=true", r"algo\.use_liger_loss=True.*one advantage per sequence"),
        ("+algo.advantage.gamma=1.5", r"algo\.advantage\.gamma=1\.5"),
        ("+algo.advantage.omega=1", r"algo\.advantage\.omega=1.*scale, step_weight, gamma"),
    ],
)
def test_gigpo_refuses_what_it_cannot_do(override, named):
    overrides = [*MULTI_TURN, "algo=cispo", "algo.advantage.name=gigpo", override]
    with pytest.raises(ConfigError, match=named):
        validate(compose_config(overrides, Path("/tmp/unused")))


# ----------------------------------------------------------------------------------- training
@pytest.mark.slow
def test_cispo_with_gigpo_trains_two_steps_on_a_multiturn_env(tmp_path):
    cfg = compose_config(
        [*MULTI_TURN, "algo=cispo", "algo.advantage=gigpo", "trainer.enable_progress_bar=false"],
        output_dir=tmp_path / "run",
    )
    validate(cfg)
    seen: list[tuple] = []

    def hook(module):
        family = module.learner.family
        original = family.advantages

        def spy(learner, member, traj, rewards, returns, kl_rewards=None):
            out = original(learner, member, traj, rewards, returns, kl_rewards)
            seen.append((traj, rewards.clone(), out))
            return out

        family.advantages = spy
        module.before = [p.detach().clone() for p in module.policy.trainable_parameters()]

    module, trainer = fit_steps(cfg, tmp_path, steps=2, module_hook=hook)
    assert trainer.global_step == 2 and len(seen) == 2
    after = list(module.policy.trainable_parameters())
    assert any(not torch.equal(b, a.detach()) for b, a in zip(module.before, after))
    assert "rollout/anchor_shared_frac" in trainer.callback_metrics
    several_turns = False
    for traj, rewards, out in seen:
        assert out.tokens.shape == traj.turn_ids.shape
        n = traj.num_turns.tolist()
        several_turns |= max(n) > 1
        expected = reference(
            [rewards[i, : n[i]].double().tolist() for i in range(len(n))],
            traj.group_ids.tolist(),
            [traj.state_ids[i, : n[i]].tolist() for i in range(len(n))],
            gamma=0.95,
            omega=1.0,
        )
        for i in range(len(n)):
            for k in range(n[i]):
                tokens = out.tokens[i][traj.turn_ids[i] == k]
                assert torch.allclose(
                    tokens.double(), torch.tensor(expected[i][k], dtype=torch.float64), atol=1e-5
                )
            assert out.tokens[i][traj.turn_ids[i] < 0].eq(0).all()
    assert several_turns
