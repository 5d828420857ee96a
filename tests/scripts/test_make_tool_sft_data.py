"""Tool-use SFT dialogues: episodes of the real ``env=tools`` env, replayable exactly, in the
harness's token layout (the tools system turn included), with a quality knob that moves the
success rate and every kind of mistake present, deterministic in the seed."""

from __future__ import annotations

import importlib.util
import itertools
import json
import re
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from rlhf_lightning.config import ASSETS
from rlhf_lightning.data.offline import encode_conversation
from rlhf_lightning.envs.tool_tasks import CalculatorToolEnv, calc_problem
from rlhf_lightning.records.sampling import Completion, SamplingParams
from rlhf_lightning.rollout.episodes.chat import env_tools
from rlhf_lightning.rollout.episodes.harness import ChatFormatter, RolloutHarness
from tests.conftest import ROOT

spec = importlib.util.spec_from_file_location(
    "make_tool_sft_data", ROOT / "scripts" / "make_tool_sft_data.py"
)
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)

CALL = re.compile(
    r'<tool_call>\{"name": "calculator", "arguments": \{"expr(ession)?": "[0-9 x*+-]+"\}\}?</tool_call>'
)
NUMBER = re.compile(r"-?\d+")


def make_env() -> CalculatorToolEnv:
    return CalculatorToolEnv(max_tool_calls=3)  # conf/env/tools.yaml's


def test_dialogues_are_question_then_replies_and_tool_results():
    for d in tool.tool_use_dialogues(300, 0.5):
        msgs = d["messages"]
        assert msgs[0]["role"] == "user" and msgs[-1]["role"] == "assistant"
        assert all(m["role"] != "system" for m in msgs)  # the formatter adds the tools system turn
        replies = [m for m in msgs if m["role"] == "assistant"]
        assert 1 <= len(replies) <= tool.MAX_TURNS
        for prev, m in itertools.pairwise(msgs):
            # each call reply is followed by exactly one tool message (one call per reply; a
            # call whose JSON does not parse names no tool)
            if prev["role"] == "assistant":
                assert m["role"] == "tool" and m["name"] in ("calculator", "")
        for m in replies[:-1]:
            assert CALL.fullmatch(m["content"]), m["content"]
        last = replies[-1]["content"]
        assert NUMBER.fullmatch(last), last  # the final answer: a bare number


def test_replaying_the_replies_in_a_fresh_env_gives_the_same_tool_results_and_outcome():
    for d in tool.tool_use_dialogues(200, 0.5, seed=3):
        env = make_env()
        obs, _ = env.reset(seed=d["row"], row_index=d["row"])
        msgs = d["messages"]
        assert msgs[0]["content"] == obs
        idx = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        total = 0.0
        for k, i in enumerate(idx):
            obs, reward, terminated, truncated, info = env.step(msgs[i]["content"])
            total += reward
            last = k == len(idx) - 1
            assert terminated == last and not truncated
            if not last:
                assert msgs[i + 1 : idx[k + 1]] == obs
        assert total == pytest.approx(d["return"])
        assert d["success"] == info["correct"] == (d["return"] == 1.0)
        # success means the final answer is the problem's answer, independently computed
        _, answer = calc_problem(0, d["row"], False)
        assert d["success"] == (int(msgs[-1]["content"]) == answer)


def tools_tokenizer() -> PreTrainedTokenizerFast:
    from rlhf_lightning.models.tiny import build_tokenizer

    corpus = [json.dumps(d["messages"]) for d in tool.tool_use_dialogues(50, 0.5)]
    tok = build_tokenizer(corpus, vocab_size=400)
    tok.chat_template = (ASSETS / "chat_templates" / "tools.jinja").read_text()
    return tok


def test_dialogues_are_token_exact_harness_rollouts():
    """SFT on a dialogue trains on exactly the ids the harness builds when the model replies so,
    the system turn listing the calculator included."""
    tok = tools_tokenizer()
    formatter = ChatFormatter(tok, tools=env_tools(make_env))

    class Scripted:
        def __init__(self, replies: list[str]) -> None:
            self.replies = iter(replies)

        def generate(self, prompts, params):
            ids = [*tok(next(self.replies), add_special_tokens=False).input_ids, tok.eos_token_id]
            return [Completion(ids, [0.0] * len(ids), "stop", 0)]

    dialogues = tool.tool_use_dialogues(40, 0.5, seed=1)
    assert {len(d["messages"]) for d in dialogues} >= {2, 4, 6}  # one, two and three replies
    for d in dialogues:
        replies = [m["content"] for m in d["messages"] if m["role"] == "assistant"]
        harness = RolloutHarness(make_env, tok, formatter, max_turns=tool.MAX_TURNS, max_model_len=1024)
        result = harness.rollout(Scripted(replies), [d["row"]], SamplingParams(max_new_tokens=60))
        traj = result.trajectories[0]
        want = encode_conversation(d["messages"], formatter)
        assert traj.token_ids == want.token_ids and traj.action_turn == want.action_turn
        assert sum(traj.rewards) == pytest.approx(d["return"])
        assert "calculator" in traj.prompt_text and "<tools>" in traj.prompt_text


def test_quality_raises_the_success_rate():
    def rate(q: float, n: int = 400) -> float:
        rows = tool.tool_use_dialogues(n, q)
        return sum(r["success"] for r in rows) / n

    rates = [rate(q) for q in (0.0, 0.5, 1.0)]
    assert rates[0] < rates[1] < rates[2] == 1.0, rates
    assert rates[0] < 0.1  # only lucky direct guesses (0.1 of the direct answers) and none else
    # quality 1: the question's expression in one call, then its result
    for d in tool.tool_use_dialogues(50, 1.0):
        expr, answer = calc_problem(0, d["row"], False)
        assert [m["content"] for m in d["messages"][1:]] == [tool.call_text(expr), str(answer), str(answer)]


def test_every_kind_of_mistake_occurs_and_the_env_answers_it():
    rows = tool.tool_use_dialogues(600, 0.3, seed=2)
    tool_texts = [m["content"] for d in rows for m in d["messages"] if m["role"] == "tool"]
    assert any("calculator raised CalcError: unexpected 'x'" in t for t in tool_texts)
    assert any(t.startswith("error: malformed tool call (invalid JSON") for t in tool_texts)
    assert any(
        t.startswith("error: invalid arguments for calculator: missing 'expression'") for t in tool_texts
    )
    firsts = [d["messages"][1]["content"] for d in rows]
    assert any(NUMBER.fullmatch(f) for f in firsts)  # a direct answer
    partial = [d for d in rows if re.search(r'"expression": "\d+ \* \d+"', d["messages"][1]["content"])]
    assert partial and any(len(d["messages"]) == 6 for d in partial)  # finished with a second call
    assert any(len(d["messages"]) == 4 and not d["success"] for d in partial)  # answered the product
    # copy errors: a full call's correct result, then a different final number
    full = [
        d
        for d in rows
        if len(d["messages"]) == 4 and not re.search(r'"\d+ \* \d+"', d["messages"][1]["content"])
    ]
    assert any(d["messages"][2]["content"] != d["messages"][3]["content"] for d in full)


def test_limit_note_is_kept_and_the_answer_follows_it():
    """A third call's result carries the env's limit note; the policy still reads the number."""
    rows = tool.tool_use_dialogues(2000, 0.5, seed=0)
    limited = [d for d in rows if any("last tool call allowed" in m["content"] for m in d["messages"])]
    assert limited
    for d in limited:
        assert len([m for m in d["messages"] if m["role"] == "assistant"]) == 4
        assert NUMBER.fullmatch(d["messages"][-1]["content"])


def test_deterministic_in_the_seed_and_written_as_jsonl(tmp_path: Path):
    a, b = tool.tool_use_dialogues(100, 0.5, seed=5), tool.tool_use_dialogues(100, 0.5, seed=5)
    assert a == b and a != tool.tool_use_dialogues(100, 0.5, seed=6)
    assert [d["row"] for d in tool.tool_use_dialogues(5, 0.5, first_row=30)] == list(range(30, 35))
    tool.write_jsonl(a, tmp_path / "d.jsonl")
    assert [json.loads(line) for line in (tmp_path / "d.jsonl").read_text().splitlines()] == a


def test_copy_quality_sets_how_often_the_result_is_copied_into_the_answer():
    def copied(d):  # (final answer == the calculator's last result) after a full-result call
        msgs = d["messages"]
        return msgs[-1]["content"] == msgs[-2]["content"].split("\n")[0]

    def after_full_result(rows):
        # ends with a call's numeric result, then a number, and was not a partial product
        return [
            d
            for d in rows
            if len(d["messages"]) >= 4
            and NUMBER.fullmatch(d["messages"][-2]["content"].split("\n")[0])
            and not re.search(r'"\d+ \* \d+"', d["messages"][-3]["content"])
        ]

    never = after_full_result(tool.tool_use_dialogues(300, 1.0, copy_quality=0.0))
    assert len(never) == 300 and not any(copied(d) or d["success"] for d in never)
    always = after_full_result(tool.tool_use_dialogues(600, 0.3, copy_quality=1.0))
    assert always and all(copied(d) and d["success"] for d in always)
    some = after_full_result(tool.tool_use_dialogues(2000, 0.5, copy_quality=0.8))
    share = sum(copied(d) for d in some) / len(some)
    assert 0.75 < share < 0.85, share  # binomial sd ~0.01 on ~1,300 answers
