"""SFT dialogues of tool use: scripted policies of mixed quality playing ``env=tools``.

Every dialogue is an episode of the real :class:`~rlhf_lightning.envs.tool_tasks.CalculatorToolEnv`
(``conf/env/tools.yaml``'s arguments: the hermes parser, 3 tool calls, 4 turns), played as the
rollout harness plays it: ``reset(seed=row, row_index=row)``, then ``step`` with each scripted
reply. The dialogue is what the harness shows the model, as chat messages: the question as the
user turn, each assistant reply as written (tool calls are ``<tool_call>{"name": "calculator",
"arguments": {"expression": ...}}</tool_call>`` blocks in the reply text), and the env's tool
messages (``{"role": "tool", "name": "calculator", "content": ...}``) as the env returned them.
No system message: the chat formatter adds the system turn that lists the tools (from the env's
``tool_schemas()``) in SFT and RL alike, so :func:`rlhf_lightning.data.offline.encode_conversation`
turns a dialogue into exactly the ids of a harness rollout.

``quality`` is the probability that each decision is the good move; otherwise the policy makes
a plausible mistake, so that a model fine-tuned on the mix succeeds sometimes and RL has room.
Copying the calculator's result into the final answer has its own ``copy_quality``: the shipped
build uses quality 0.3 and copy quality 0.9 (data success 0.43), so the SFT-ed model copies well
and what RL has to learn is mostly *whether and how* to call the tool (its first move):

- first move: good = call the calculator with the question's expression. Bad: answer directly
  (a guess, right with probability ``direct_correct``), a partial call (``a * b`` only), or a
  malformed call (``x`` for ``*``, which the calculator refuses; invalid JSON; or a wrong
  argument name), each answered by the env's error message, then a fresh decision (never a
  second malformed call).
- after the partial product: good = call it again with ``<product> +- c``; bad = answer the
  partial product.
- after the full result: answer it with probability ``copy_quality``, else a copy error (a near
  miss of the result: off by 1-9 or by tens, or two digits swapped).

The final answer is the bare number (the env scores the last integer of a reply with no call).

    python scripts/make_tool_sft_data.py --out tool_sft.jsonl --dialogues 4000 --quality 0.3 --copy-quality 0.9

Each JSONL line: ``{"messages", "env", "row", "return", "success"}`` (``algo.data_path`` reads
``messages``; the rest is for inspection and replay).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling scripts, also when a test imports this
from make_chat_sft_data import Message, Policy, near_miss, play, success_rates, write_jsonl

from rlhf_lightning.envs.tool_parsers import ToolCall, parse_hermes
from rlhf_lightning.envs.tool_tasks import CalculatorToolEnv, calculator

ENV = "tools"
MAX_TURNS = 4  # conf/env/tools.yaml's max_turns
ENV_KWARGS: dict[str, Any] = {"max_tool_calls": 3}  # conf/env/tools.yaml's (the rest: defaults)
DEFAULT_QUALITY = 0.3
DEFAULT_COPY_QUALITY = 0.9
_QUESTION = re.compile(r"What is (.+?)\? Use the calculator")
_NUMBER = re.compile(r"-?\d+")
MALFORMED = ("times_as_x", "invalid_json", "wrong_argument")


def call_text(expression: str, argument: str = "expression") -> str:
    """A hermes tool call of the calculator, as the ``tools.jinja`` system turn asks for it."""
    body = json.dumps({"name": "calculator", "arguments": {argument: expression}})
    return f"<tool_call>{body}</tool_call>"


def malformed_call(expression: str, kind: str) -> str:
    """A call the env answers with an error: ``x`` for ``*`` (the calculator raises), a JSON
    body missing its last brace (the parser refuses it), or an unknown argument name."""
    if kind == "times_as_x":
        return call_text(expression.replace("*", "x"))
    if kind == "invalid_json":
        return call_text(expression).replace("}}</tool_call>", "}</tool_call>")
    if kind == "wrong_argument":
        return call_text(expression, argument="expr")
    raise ValueError(f"unknown malformed call kind {kind!r}; choose from {MALFORMED}")


def question_expression(messages: list[Message]) -> str:
    """The ``a * b +- c`` of the dialogue's question (its first message)."""
    found = _QUESTION.search(messages[0]["content"])
    if found is None:
        raise ValueError(f"not a calculator question: {messages[0]['content']!r}")
    return found.group(1)


def last_call(messages: list[Message]) -> str | None:
    """The expression of the last assistant reply's calculator call, when it was a valid one."""
    replies = [m["content"] for m in messages if m["role"] == "assistant"]
    if not replies:
        return None
    calls = parse_hermes(replies[-1]).items
    if len(calls) != 1 or not isinstance(calls[0], ToolCall):
        return None
    expression = calls[0].arguments.get("expression")
    return expression if isinstance(expression, str) else None


def last_result(messages: list[Message]) -> int | None:
    """The calculator's answer in the last message when it is a tool result that is a number
    (the env may append a note about the call limit on the next line), else None."""
    last = messages[-1]
    if last["role"] != "tool":
        return None
    first_line = last["content"].split("\n", 1)[0]
    return int(first_line) if _NUMBER.fullmatch(first_line) else None


def tool_use_policy(quality: float, direct_correct: float = 0.1, copy_quality: float | None = None) -> Policy:
    """Scripted :class:`CalculatorToolEnv` player of the module doc: each decision is the good
    move with probability ``quality``, except copying the final result, right with probability
    ``copy_quality`` (default: ``quality``)."""
    copy_q = quality if copy_quality is None else copy_quality

    def policy(messages: list[Message], rng: random.Random) -> str:
        expr = question_expression(messages)
        a, op_ab, b, op_c, c = expr.split()
        draw = rng.random()
        good = draw < quality
        value, call = last_result(messages), last_call(messages)
        if value is not None and call is not None:
            if call == f"{a} {op_ab} {b}":  # the partial product: finish it, or answer it as is
                return call_text(f"{value} {op_c} {c}") if good else str(value)
            return str(value if draw < copy_q else near_miss(value, rng))  # or miscopy the result
        if good:
            return call_text(expr)
        first = len(messages) == 1  # after a tool error: no second malformed call
        moves = ["direct", "partial", "malformed"] if first else ["direct", "partial"]
        move = rng.choices(moves, [0.45, 0.3, 0.25] if first else [0.6, 0.4])[0]
        if move == "direct":
            answer = int(calculator(expr))
            return str(answer if rng.random() < direct_correct else near_miss(answer, rng))
        if move == "partial":
            return call_text(f"{a} {op_ab} {b}")
        return malformed_call(expr, rng.choice(MALFORMED))

    return policy


def _rng(seed: int, row: int) -> random.Random:
    return random.Random(f"tool-sft:{seed}:{row}")


def tool_use_dialogues(
    n: int,
    quality: float = DEFAULT_QUALITY,
    seed: int = 0,
    first_row: int = 0,
    env_kwargs: Mapping[str, Any] | None = None,
    max_turns: int = MAX_TURNS,
    direct_correct: float = 0.1,
    copy_quality: float | None = None,
) -> list[dict[str, Any]]:
    """``n`` episodes of :class:`CalculatorToolEnv` on train rows ``first_row ...`` (see the
    module doc), in row order. Deterministic in its arguments."""
    env = CalculatorToolEnv(**{**ENV_KWARGS, **(env_kwargs or {})})
    policy = tool_use_policy(quality, direct_correct, copy_quality)
    out = []
    for row in range(first_row, first_row + n):
        messages, rewards, infos = play(env, row, policy, _rng(seed, row), max_turns)
        out.append(
            {
                "messages": messages,
                "env": ENV,
                "row": row,
                "return": round(sum(rewards), 6),
                "success": bool(infos[-1].get("correct", False)),
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--first-row", type=int, default=0, help="first train row")
    ap.add_argument("--dialogues", type=int, default=4000)
    ap.add_argument("--quality", type=float, default=DEFAULT_QUALITY)
    ap.add_argument(
        "--copy-quality", type=float, default=DEFAULT_COPY_QUALITY, help="final answers copied right"
    )
    ap.add_argument("--direct-correct", type=float, default=0.1, help="chance that a direct guess is right")
    args = ap.parse_args()
    rows = tool_use_dialogues(
        args.dialogues,
        args.quality,
        args.seed,
        args.first_row,
        direct_correct=args.direct_correct,
        copy_quality=args.copy_quality,
    )
    write_jsonl(rows, args.out)
    print(f"wrote {len(rows)} dialogues to {args.out}; success {success_rates(rows)[ENV]:.3f}")


if __name__ == "__main__":
    main()
