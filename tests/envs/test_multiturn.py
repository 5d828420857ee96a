"""Token-exact multi-turn episodes: a scripted engine plays every env, and each trajectory is
rebuilt independently (replaying the env) and compared id by id."""

from __future__ import annotations

import random

import pytest
import torch

from rlhf_lightning.envs.arithmetic import ArithmeticEnv
from rlhf_lightning.envs.guess_number import GuessNumberEnv
from rlhf_lightning.envs.math import MathEnv
from rlhf_lightning.envs.sudoku import SudokuEnv
from rlhf_lightning.envs.tool_calc import ToolCalcEnv
from rlhf_lightning.records.sampling import Completion, SamplingParams
from rlhf_lightning.rollout.episodes.harness import ChatFormatter, RolloutHarness

REPLIES = [
    "7",
    "12",
    "3",
    "1 2 3",
    "2 4 1",
    "CALC(12 * 3)",
    "ANSWER: 36",
    "\\boxed{54}",
    "higher?",
    "10",
    "5",
]


class RandomEngine:
    """Replies with random texts from REPLIES; ~1 in 8 replies is cut (no eos, finish 'length')."""

    def __init__(self, tokenizer, seed: int = 0, cut_prob: float = 0.125) -> None:
        self.tok, self.rng, self.cut_prob = tokenizer, random.Random(seed), cut_prob
        self.log: list[list[tuple[list[int], list[int]]]] = []  # per call: (prompt, reply ids)

    def generate(self, prompt_token_ids, params):
        out, call = [], []
        for i, prompt in enumerate(prompt_token_ids):
            ids = self.tok(self.rng.choice(REPLIES), add_special_tokens=False).input_ids[
                : params.max_new_tokens
            ]
            cut = self.rng.random() < self.cut_prob or len(ids) >= params.max_new_tokens
            if not cut:
                ids = [*ids, self.tok.eos_token_id]
            out.append(Completion(ids, [-0.25] * len(ids), "length" if cut else "stop", i))
            call.append((list(prompt), ids))
        self.log.append(call)
        return out

    def sleep(self):
        pass

    def wake(self):
        pass

    def sync_weights(self, model):
        pass


ENVS = {
    "arithmetic": (ArithmeticEnv, 1),
    "guess_number": (lambda: GuessNumberEnv(max_turns=5), 5),
    "sudoku": (lambda: SudokuEnv(blanks=4, max_invalid=3), 6),
    "tool_calc": (ToolCalcEnv, 4),
    "math": (MathEnv, 1),
}


def replay(env_factory, row, texts, formatter, tok):
    """The expected ids, masks and rewards of one episode, built without the harness."""
    env = env_factory()
    obs, _ = env.reset(seed=row, row_index=row)
    ids = formatter.prompt_ids(obs)
    turns = [-1] * len(ids)
    rewards = []
    for k, (text, gen) in enumerate(texts):
        ids += gen
        turns += [k] * len(gen)
        obs, reward, *_ = env.step(text)
        rewards.append(reward)
        if k + 1 < len(texts):
            obs_ids = formatter.observation_ids(obs)
            ids += obs_ids
            turns += [-1] * len(obs_ids)
    return ids, turns, rewards


@pytest.mark.parametrize("name", list(ENVS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_episodes_are_token_exact(tiny_tokenizer, name, seed):
    tok = tiny_tokenizer
    factory, max_turns = ENVS[name]
    engine = RandomEngine(tok, seed=seed)
    formatter = ChatFormatter(tok, system_prompt="Be brief." if seed == 1 else None)
    harness = RolloutHarness(factory, tok, formatter, max_turns=max_turns, max_model_len=400)
    rows = [3, 8, 5]
    result = harness.rollout(engine, rows, SamplingParams(max_new_tokens=6), group_size=2)
    b = result.batch
    assert b.input_ids.shape[0] == 6 and b.group_ids.tolist() == [0, 0, 1, 1, 2, 2]
    for i, traj in enumerate(result.trajectories):
        # The ids of turn k, and the prefix the engine saw when it generated them (its k-th call).
        gens = [
            [t for t, k in zip(traj.token_ids, traj.action_turn) if k == turn]
            for turn in range(traj.num_turns)
        ]
        for turn, gen in enumerate(gens):
            start = traj.action_turn.index(turn)
            assert (traj.token_ids[:start], gen) in engine.log[turn], "not what the engine generated"
        texts = [(tok.decode(g, skip_special_tokens=True), g) for g in gens]
        ids, turns, rewards = replay(factory, rows[i // 2], texts, formatter, tok)
        n = len(ids)
        assert b.input_ids[i, :n].tolist() == ids
        assert b.attention_mask[i].sum().item() == n
        assert b.turn_ids[i, : n - 1].tolist() == turns[1:]
        assert b.turn_ids[i, n - 1 :].eq(-1).all()
        assert torch.equal(b.action_mask[i], b.turn_ids[i] >= 0)
        assert b.rewards[i, : len(rewards)].tolist() == pytest.approx(rewards)
        assert b.rewards[i, len(rewards) :].eq(0).all()
        assert b.num_turns[i].item() == len(rewards)
        assert torch.allclose(b.sampling_logps[i][b.action_mask[i]], torch.tensor(-0.25))


def test_multi_turn_text_matches_the_chat_template(tiny_tokenizer):
    """Decoding a finished episode gives exactly the template's rendering of the conversation."""
    tok = tiny_tokenizer

    class Fixed:
        def generate(self, prompts, params):
            return [
                Completion(
                    [*tok("10", add_special_tokens=False).input_ids, tok.eos_token_id], [0.0] * 3, "stop", i
                )
                for i in range(len(prompts))
            ]

    harness = RolloutHarness(lambda: GuessNumberEnv(max_turns=3), tok, ChatFormatter(tok), max_turns=3)
    traj = harness.rollout(Fixed(), [4], SamplingParams(max_new_tokens=4)).trajectories[0]
    env = GuessNumberEnv(max_turns=3)
    first, _ = env.reset(row_index=4, seed=4)
    messages = [{"role": "user", "content": first}]
    for _ in range(traj.num_turns - 1):
        obs = env.step("10")[0]
        messages += [{"role": "assistant", "content": "10"}, {"role": "user", "content": obs}]
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    text = tok.decode(traj.token_ids, skip_special_tokens=False)
    assert text.startswith(rendered) and text[len(rendered) :] == "10<|im_end|>"


def test_batch_rows_do_not_depend_on_other_episodes(tiny_tokenizer):
    tok = tiny_tokenizer
    harness = RolloutHarness(lambda: GuessNumberEnv(max_turns=5), tok, ChatFormatter(tok), max_turns=5)
    alone = harness.rollout(RandomEngine(tok, seed=4, cut_prob=0), [11], SamplingParams(max_new_tokens=6))
    together = harness.rollout(
        RandomEngine(tok, seed=4, cut_prob=0), [11, 2, 7], SamplingParams(max_new_tokens=6)
    )
    a, t = alone.batch, together.batch
    n = a.attention_mask[0].sum().item()
    # The engine's first reply goes to row 11 in both runs; later turns differ by the rng order,
    # so compare the episode's own ids, not the neighbours'.
    if alone.trajectories[0].num_turns == together.trajectories[0].num_turns == 1:
        assert t.input_ids[0, :n].tolist() == a.input_ids[0, :n].tolist()
    for batch in (a, t):
        for i in range(len(batch)):
            m = batch.attention_mask[i].sum().item()
            assert batch.input_ids[i, m:].eq(tok.pad_token_id).all()
            assert not batch.action_mask[i, m - 1 :].any()


def test_max_turns_and_max_model_len_truncate(tiny_tokenizer):
    tok = tiny_tokenizer
    wrong = tok("99", add_special_tokens=False).input_ids + [tok.eos_token_id]  # never in [1, 20]

    class Wrong:
        def generate(self, prompts, params):
            return [Completion(list(wrong), [0.0] * len(wrong), "stop", i) for i in range(len(prompts))]

    h = RolloutHarness(
        lambda: GuessNumberEnv(max_turns=10), tok, ChatFormatter(tok), max_turns=3, max_model_len=400
    )
    traj = h.rollout(Wrong(), [0], SamplingParams(max_new_tokens=4)).trajectories[0]
    assert traj.num_turns == 3 and traj.truncated  # cut by the harness's turn limit
    prompt_len = traj.prompt_len
    h2 = RolloutHarness(
        lambda: GuessNumberEnv(max_turns=10),
        tok,
        ChatFormatter(tok),
        max_turns=10,
        max_model_len=prompt_len + 40,
    )
    traj = h2.rollout(Wrong(), [0], SamplingParams(max_new_tokens=4)).trajectories[0]
    assert traj.truncated and len(traj.token_ids) <= prompt_len + 40
    assert traj.num_turns < 10
    # every generated turn is whole: each ends with the eos token
    turns = [t for t in traj.action_turn if t >= 0]
    assert len(turns) == traj.num_turns * len(wrong)


def test_long_prompts_are_dropped_and_counted(tiny_tokenizer, caplog):
    tok = tiny_tokenizer
    harness = RolloutHarness(ArithmeticEnv, tok, ChatFormatter(tok), max_turns=1, max_model_len=30)
    with caplog.at_level("WARNING"):
        result = harness.rollout(
            RandomEngine(tok), list(range(40)), SamplingParams(max_new_tokens=4), group_size=2
        )
    dropped = result.metrics["rollout/dropped_long_prompts"]
    assert 0 < dropped < 40
    assert len(result.trajectories) == 2 * (40 - dropped)
    assert all(len(t.token_ids) <= 30 for t in result.trajectories)
    assert any("dropped" in r.getMessage() and "max_model_len=30" in r.getMessage() for r in caplog.records)
    tiny = RolloutHarness(ArithmeticEnv, tok, ChatFormatter(tok), max_turns=1, max_model_len=8)
    with pytest.raises(ValueError, match=r"raise env\.max_model_len"):
        tiny.rollout(RandomEngine(tok), [0], SamplingParams(max_new_tokens=4))


class Exploding:
    def reset(self, seed=None, *, row_index=None, evaluation=False):
        return "What is 1 plus 1?", {}

    def step(self, action):
        raise ZeroDivisionError("bad reward function")


def test_reward_errors_raise_with_context_or_score_zero(tiny_tokenizer):
    tok = tiny_tokenizer
    h = RolloutHarness(Exploding, tok, ChatFormatter(tok))
    with pytest.raises(
        RuntimeError,
        match=r"(?s)Exploding.step raised ZeroDivisionError: bad reward function.*prompt: .*What is 1 plus 1.*completion: ",
    ):
        h.rollout(RandomEngine(tok), [0], SamplingParams(max_new_tokens=4))
    h = RolloutHarness(Exploding, tok, ChatFormatter(tok), on_reward_error="zero")
    result = h.rollout(RandomEngine(tok), [0, 1], SamplingParams(max_new_tokens=4), group_size=2)
    assert result.metrics["env/reward_errors"] == 4 and result.batch.rewards.eq(0).all()


def test_observation_text_without_chat_template(tiny_tokenizer):
    f = ChatFormatter(tiny_tokenizer, apply_chat_template=False)
    assert f.prompt_text("Guess.") == "Guess." and f.observation_text("Higher.") == "\nHigher.\n"


def test_rollout_reports_each_turn_to_progress(tiny_tokenizer):
    """``progress`` hears each turn before its generation, with the episodes still going."""
    tok = tiny_tokenizer
    engine = RandomEngine(tok, seed=1)
    harness = RolloutHarness(lambda: GuessNumberEnv(max_turns=3), tok, ChatFormatter(tok), max_turns=3)
    heard: list[str] = []
    result = harness.rollout(
        engine, [1, 2], SamplingParams(max_new_tokens=4), group_size=2, progress=heard.append
    )
    assert heard[0] == "rollout: turn 1/3, 4 episodes" and len(heard) == len(engine.log)
    for k, (msg, call) in enumerate(zip(heard, engine.log)):
        assert msg == f"rollout: turn {k + 1}/3, {len(call)} episodes"
    assert len(result.trajectories) == 4
    single = RolloutHarness(ArithmeticEnv, tok, ChatFormatter(tok), max_turns=1)
    heard.clear()
    single.rollout(
        RandomEngine(tok), [0], SamplingParams(max_new_tokens=4), group_size=3, progress=heard.append
    )
    assert heard == ["rollout: 3 episodes"]
