"""Chat SFT dialogues: played against the real envs, in the harness's token layout, with a quality
knob that moves the success rate, deterministic in the seed."""

from __future__ import annotations

import importlib.util
import json
import re
import sys

import pytest

from rlhf_lightning.data.offline import SFTDataset, encode_conversation
from rlhf_lightning.envs.arithmetic import ArithmeticEnv
from rlhf_lightning.envs.files import read_rows
from rlhf_lightning.envs.guess_number import GuessNumberEnv
from rlhf_lightning.envs.tool_calc import ToolCalcEnv
from rlhf_lightning.records.sampling import Completion, SamplingParams
from rlhf_lightning.rollout.episodes.harness import ChatFormatter, RolloutHarness
from tests.conftest import ROOT

spec = importlib.util.spec_from_file_location(
    "make_chat_sft_data", ROOT / "scripts" / "make_chat_sft_data.py"
)
chat = importlib.util.module_from_spec(spec)
spec.loader.exec_module(chat)

ENVS = {  # name: (fresh env as conf/env/<name>.yaml builds it, harness max_turns, reply format)
    "guess_number": (lambda: GuessNumberEnv(max_turns=5), 5, re.compile(r"\d{1,2}")),
    "tool_calc": (ToolCalcEnv, 4, re.compile(r"CALC\([0-9 x*+-]+\)|ANSWER: -?\d+")),
    "arithmetic": (ArithmeticEnv, 1, re.compile(r"\d+")),
}
QUALITY = {"guess_number": 0.6, "tool_calc": 0.5, "arithmetic": 0.8}


def dialogues(name: str, n: int = 200, quality: float | None = None, seed: int = 0) -> list[dict]:
    q = QUALITY[name] if quality is None else quality
    return chat.GENERATORS[name](n, q, seed=seed)


@pytest.mark.parametrize("name", list(ENVS))
def test_dialogues_alternate_user_and_short_assistant_replies(name):
    _, max_turns, reply_format = ENVS[name]
    for d in dialogues(name):
        roles = [m["role"] for m in d["messages"]]
        # no system message (the formatter adds env.system_prompt); ends with the last reply
        assert roles == ["user", "assistant"] * (len(roles) // 2) and len(roles) % 2 == 0
        assert 1 <= roles.count("assistant") <= max_turns
        for m in d["messages"][1::2]:
            assert reply_format.fullmatch(m["content"]), m["content"]
            assert len(m["content"]) <= 20 and "<|im_end|>" not in m["content"]


@pytest.mark.parametrize("name", list(ENVS))
def test_replaying_the_replies_in_a_fresh_env_gives_the_same_env_turns(name):
    make_env, max_turns, _ = ENVS[name]
    for d in dialogues(name, n=100):
        env = make_env()
        obs, _ = env.reset(seed=d["row"], row_index=d["row"])
        msgs = d["messages"]
        assert msgs[0]["content"] == obs
        total, replies = 0.0, msgs[1::2]
        for k, reply in enumerate(replies):
            obs, reward, terminated, truncated, info = env.step(reply["content"])
            total += reward
            last = k == len(replies) - 1
            assert (terminated or truncated or k + 1 == max_turns) == last
            if not last:
                assert msgs[2 * k + 2]["content"] == obs
        assert total == pytest.approx(d["return"])
        assert d["success"] == bool(info.get("solved", info.get("correct")))


@pytest.mark.parametrize("name", ["guess_number", "tool_calc"])
def test_episodes_are_token_exact_harness_rollouts(tiny_tokenizer, name):
    """SFT on a dialogue trains on exactly the ids the harness builds when the model replies so."""
    tok = tiny_tokenizer
    make_env, max_turns, _ = ENVS[name]
    formatter = ChatFormatter(tok)

    class Scripted:
        def __init__(self, replies: list[str]) -> None:
            self.replies = iter(replies)

        def generate(self, prompts, params):
            ids = [*tok(next(self.replies), add_special_tokens=False).input_ids, tok.eos_token_id]
            return [Completion(ids, [0.0] * len(ids), "stop", 0)]

    for d in dialogues(name, n=8):
        replies = [m["content"] for m in d["messages"][1::2]]
        harness = RolloutHarness(make_env, tok, formatter, max_turns=max_turns, max_model_len=512)
        result = harness.rollout(Scripted(replies), [d["row"]], SamplingParams(max_new_tokens=40))
        traj = result.trajectories[0]
        want = encode_conversation(d["messages"], formatter)
        assert traj.token_ids == want.token_ids and traj.action_turn == want.action_turn
        assert sum(traj.rewards) == pytest.approx(d["return"])


def test_quality_raises_the_success_rate():
    for name in ("guess_number", "tool_calc"):
        rates = [chat.success_rates(dialogues(name, 300, q))[name] for q in (0.0, 0.5, 1.0)]
        assert rates[0] < rates[1] < rates[2], (name, rates)
    assert chat.success_rates(dialogues("tool_calc", 100, 1.0))["tool_calc"] == 1.0
    assert chat.success_rates(dialogues("guess_number", 100, 0.0))["guess_number"] == 0.0
    assert chat.success_rates(dialogues("arithmetic", 100, 1.0))["arithmetic"] == 1.0


def test_guess_number_good_moves_follow_the_feedback_and_bad_moves_do_not():
    def moves(d):  # (guess, the interval the feedback so far allows)
        msgs = d["messages"]
        return [
            (int(msgs[i]["content"]), chat.consistent_interval(msgs[:i], 1, 20))
            for i in range(1, len(msgs), 2)
        ]

    good = [m for d in dialogues("guess_number", 100, 1.0) for m in moves(d)]
    bad = [m for d in dialogues("guess_number", 100, 0.0) for m in moves(d)]
    assert all(lo <= g <= hi for g, (lo, hi) in good)
    assert all(not lo <= g <= hi and 0 <= g <= 23 for g, (lo, hi) in bad)
    # not bisection: first guesses spread over the range
    assert len({d["messages"][1]["content"] for d in dialogues("guess_number", 100, 1.0)}) > 10


def test_same_seed_same_dialogues_other_seed_others():
    counts = {"guess_number": 30, "tool_calc": 30, "arithmetic": 10}
    a = chat.chat_sft_mix(counts, seed=3)
    assert a == chat.chat_sft_mix(counts, seed=3)
    assert a != chat.chat_sft_mix(counts, seed=4)
    assert {e: sum(r["env"] == e for r in a) for e in counts} == counts
    assert [r["env"] for r in a] != sorted(r["env"] for r in a)  # shuffled
    with pytest.raises(ValueError, match="unknown env"):
        chat.chat_sft_mix({"sudoku": 3})


def test_cli_writes_rows_the_sft_dataset_reads(tmp_path, monkeypatch, tiny_tokenizer):
    out = tmp_path / "chat.jsonl"
    argv = ["x", "--out", str(out), "--guess-number", "5", "--tool-calc", "5", "--arithmetic", "2"]
    monkeypatch.setattr(sys, "argv", argv)
    chat.main()
    rows = read_rows(out)
    assert len(rows) == 12 and rows == [json.loads(line) for line in out.read_text().splitlines()]
    data = SFTDataset(rows, ChatFormatter(tiny_tokenizer), {"messages": "messages"})
    for i, row in enumerate(rows):
        traj = data[i][0]
        assert traj.num_turns == sum(m["role"] == "assistant" for m in row["messages"])
