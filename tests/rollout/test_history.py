"""env.history: what each turn's prompt holds (full, last, last_k), token-exact per turn, and the
packed rows those episodes train on."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.envs.guess_number import GuessNumberEnv
from rlhf_lightning.envs.sudoku import SudokuEnv
from rlhf_lightning.envs.tool_calc import ToolCalcEnv
from rlhf_lightning.models.build import build_policy
from rlhf_lightning.records.sampling import Completion, SamplingParams
from rlhf_lightning.rollout.episodes.chat import ChatFormatter, check_template, latest_view
from rlhf_lightning.rollout.episodes.harness import RolloutHarness
from tests.envs.test_multiturn import RandomEngine

ENVS = {
    "guess_number": (lambda: GuessNumberEnv(max_turns=5), 5),
    "sudoku": (lambda: SudokuEnv(blanks=4, max_invalid=3), 6),
    "tool_calc": (ToolCalcEnv, 4),
}


def turns_of(traj):
    """Each turn's generated ids (the trajectory's action tokens of that turn)."""
    return [
        [t for t, k in zip(traj.token_ids, traj.action_turn) if k == turn] for turn in range(traj.num_turns)
    ]


def replay_prompts(factory, row, replies, formatter, tok, history, k=2):
    """The documented prompt of every turn, built without the harness: the env replayed with the
    episode's replies, each turn's prompt rendered from its messages with the chat template."""
    env = factory()
    first, info = env.reset(seed=row, row_index=row)
    instructions = info.get("instructions", first)
    messages = [{"role": "user", "content": first}]
    out = [tok(formatter.prompt_text(first), add_special_tokens=False).input_ids]
    for reply in replies[:-1]:
        obs = env.step(tok.decode(reply, skip_special_tokens=True))[0]
        messages += [{"role": "assistant", "content": tok.decode(reply, skip_special_tokens=True)}]
        messages += [{"role": "user", "content": obs}]
        if history == "last":
            text = formatter.prompt_text(latest_view(instructions, obs))
        else:  # last_k: the first user turn, then the last k (reply, observation) pairs
            kept = [messages[0], *messages[1:][-2 * k :]]
            text = formatter.render(kept, add_generation_prompt=True)
        out.append(tok(text, add_special_tokens=False).input_ids)
    return out


@pytest.mark.parametrize("name", ["guess_number", "sudoku"])
@pytest.mark.parametrize("history,k", [("last", 1), ("last_k", 1), ("last_k", 2)])
def test_each_turn_prompt_is_the_documented_one(tiny_tokenizer, name, history, k):
    tok = tiny_tokenizer
    factory, max_turns = ENVS[name]
    engine = RandomEngine(tok, seed=3, cut_prob=0)
    formatter = ChatFormatter(tok)
    harness = RolloutHarness(
        factory, tok, formatter, max_turns=max_turns, max_model_len=600, history=history, history_k=k
    )
    rows = [3, 8]
    result = harness.rollout(engine, rows, SamplingParams(max_new_tokens=6), group_size=2)
    b = result.batch
    assert b.position_ids is not None
    multi = 0
    for i, traj in enumerate(result.trajectories):
        replies = turns_of(traj)
        expected = replay_prompts(factory, rows[i // 2], [*replies, []], formatter, tok, history, k)
        starts = [*traj.segment_starts, len(traj.token_ids)]
        # one sequence a turn, and after a truncated episode the prompt of the turn that never
        # came (the state PPO bootstraps from)
        assert len(traj.segment_starts) == traj.num_turns + (traj.truncated and not traj.cut)
        for turn, (s, e) in enumerate(itertools.pairwise(starts)):
            if turn == traj.num_turns:
                assert traj.token_ids[s:e] == expected[turn]
                continue
            # the turn's sequence: its own prompt then its reply; what the engine was given
            assert traj.token_ids[s:e] == expected[turn] + replies[turn]
            assert (expected[turn], replies[turn]) in engine.log[turn]
            assert b.position_ids[i, s:e].tolist() == list(range(e - s))
        multi += traj.num_turns > 1
    assert multi, "no episode went past its first turn"


def test_last_view_joins_the_instructions_and_the_latest_observation():
    assert latest_view("Guess a number.", "Higher.") == "Guess a number.\n\nHigher."
    assert latest_view("Rules.\n\n", "At turn 1, ...") == "Rules.\n\nAt turn 1, ..."
    tool = [{"role": "tool", "content": "42"}]
    assert latest_view("Q", tool) == [{"role": "user", "content": "Q"}, *tool]


def test_gem_last_prompt_is_gems_rules_feedback_and_the_current_board(tiny_tokenizer):
    pytest.importorskip("gem")
    from rlhf_lightning.envs.gem import GemEnv

    tok = tiny_tokenizer
    factory = functools.partial(GemEnv, "game:Sudoku-v0-easy")
    reply = [*tok("\\boxed{1 1 1}", add_special_tokens=False).input_ids, tok.eos_token_id]

    class SameMove:  # always the same well-formed move
        def generate(self, prompts, params):
            return [Completion(reply, [0.0] * len(reply), "stop", i) for i in range(len(prompts))]

    engine = SameMove()
    formatter = ChatFormatter(tok)
    harness = RolloutHarness(factory, tok, formatter, max_turns=3, max_model_len=4096, history="last")
    traj = harness.rollout(engine, [5], SamplingParams(max_new_tokens=12)).trajectories[0]
    # three turns, then the prompt of a fourth that max_turns cut off (PPO bootstraps there)
    assert traj.num_turns == 3 and traj.truncated and len(traj.segment_starts) == 4
    env = GemEnv("game:Sudoku-v0-easy")
    _, info = env.reset(row_index=5)
    rules = info["instructions"]
    assert "Here is the current board" not in rules
    starts = [*traj.segment_starts, len(traj.token_ids)]
    for turn in (1, 2, 3):
        obs = env.step("\\boxed{1 1 1}")[0]
        assert obs.startswith(f"At turn {turn}, ") and "Here is the current board layout" in obs
        text = tok.decode(traj.token_ids[starts[turn] : starts[turn + 1]])
        reply = "\\boxed{1 1 1}<|im_end|>" if turn < 3 else ""
        assert text == formatter.prompt_text(rules + obs) + reply
        assert text.count("Here is the current board layout") == 1  # only the latest board


def test_full_history_is_one_sequence(tiny_tokenizer):
    tok = tiny_tokenizer
    harness = RolloutHarness(lambda: GuessNumberEnv(max_turns=4), tok, ChatFormatter(tok), max_turns=4)
    result = harness.rollout(RandomEngine(tok, seed=1, cut_prob=0), [2, 5], SamplingParams(max_new_tokens=6))
    assert result.batch.position_ids is None
    assert all(t.segment_starts == [0] for t in result.trajectories)


def test_max_model_len_bounds_each_sequence_with_history_last(tiny_tokenizer):
    tok = tiny_tokenizer
    factory = lambda: GuessNumberEnv(max_turns=8)  # noqa: E731
    eng = lambda: RandomEngine(tok, seed=2, cut_prob=0)  # noqa: E731
    full = RolloutHarness(factory, tok, ChatFormatter(tok), max_turns=8, max_model_len=140)
    last = RolloutHarness(factory, tok, ChatFormatter(tok), max_turns=8, max_model_len=140, history="last")
    cut_by_length = full.rollout(eng(), [1, 2], SamplingParams(6)).trajectories
    assert all(len(t.token_ids) <= 140 for t in cut_by_length)
    played = last.rollout(eng(), [1, 2], SamplingParams(6)).trajectories
    assert max(t.num_turns for t in played) > max(t.num_turns for t in cut_by_length)
    assert any(len(t.token_ids) > 140 for t in played)  # the episode is not bounded, each turn is
    for t in played:
        assert max(t.segment_lengths()) <= 140


def test_a_tool_env_refuses_history_last(tiny_tokenizer):
    tok = tiny_tokenizer
    formatter = ChatFormatter(
        tok, tools=[{"type": "function", "function": {"name": "calc", "parameters": {}}}]
    )
    with pytest.raises(ConfigError, match=r"env\.history"):
        check_template(formatter, multi_turn=True, history="last")


@pytest.mark.parametrize("history", ["last", "last_k"])
def test_packed_turns_score_as_each_sequence_alone(tiny_model, tiny_tokenizer, history):
    """Log-probs (and the critic's values) of an episode's packed turns equal each turn's
    sequence run alone: positions restart and attention stays within the turn."""
    tok = tiny_tokenizer
    torch.manual_seed(0)
    policy = build_policy(tiny_model, finetune="lora", with_critic=True)
    harness = RolloutHarness(
        lambda: GuessNumberEnv(max_turns=4),
        tok,
        ChatFormatter(tok),
        max_turns=4,
        history=history,
        history_k=1,
    )
    result = harness.rollout(RandomEngine(tok, seed=5, cut_prob=0), [1, 2, 3], SamplingParams(6))
    b = result.batch
    heads = policy.forward_heads(b, ("logp", "value"))
    checked = 0
    for i, traj in enumerate(result.trajectories):
        starts = [*traj.segment_starts, len(traj.token_ids)]
        for s, e in itertools.pairwise(starts):
            ids = torch.tensor([traj.token_ids[s:e]])
            mask = torch.ones_like(ids)
            act = torch.tensor([[k >= 0 for k in traj.action_turn[s + 1 : e]]])
            alone, _ = policy.token_logprobs(ids, mask, act)
            values = policy.values(ids, mask, act)
            torch.testing.assert_close(heads["logp"][i, s : e - 1], alone[0], rtol=0, atol=1e-5)
            torch.testing.assert_close(heads["value"][i, s : e - 1], values[0], rtol=0, atol=1e-5)
            checked += 1
    assert checked > len(result.trajectories)


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_training_steps_with_history_last(fast_cfg, tmp_path, algo):
    """Two updates on guess_number with each turn its own sequence: GRPO, and PPO (turn-level
    GAE: each turn's value from its own sequence, truncated episodes bootstrapped from the
    prompt of the turn that never came)."""
    from tests.conftest import fit_steps

    cfg = fast_cfg("experiment=guess_number", f"algo={algo}", "env.history=last", "trainer.max_steps=2")
    _, trainer = fit_steps(cfg, tmp_path, steps=2)
    assert trainer.global_step == 2
    assert trainer.callback_metrics["rollout/num_turns"] > 1
