"""SFT dialogues for a tiny chat model, played against the envs by scripted policies of mixed quality.

Every dialogue is an episode of the real env class: ``reset(seed=row, row_index=row)`` as the
rollout harness calls it, then ``step`` with each scripted reply, so the user turns are exactly
what the env says during RL. A dialogue is the list of chat messages that
:func:`rlhf_lightning.data.offline.encode_conversation` turns into the harness's token layout:
the env's first observation as the user turn, then assistant replies and the env's answers in
turn. The episode's last observation is left out (the harness never shows it), and replies carry
no end-of-turn token (the SFT encoder appends eos). No system message: ``env.system_prompt``, if
set, is added by the chat formatter in SFT and RL alike.

``quality`` is the probability that each decision is the good move; otherwise the policy makes a
plausible mistake, so a model fine-tuned on the mix succeeds sometimes and RL has room to improve:

- ``guess_number``: good = a random guess consistent with the feedback so far (not bisection);
  bad = a guess 1-3 outside the consistent interval (a repeat, a contradiction, or out of range).
- ``tool_calc``: good = ``CALC(<the question's expression>)``, then ``ANSWER: <result>``. Bad first
  moves: a direct ``ANSWER:`` guess (rarely right), a partial call ``CALC(a * b)`` (good follow-up:
  ``CALC(<result> + c)``; bad: answer the partial result), or a malformed call (``x`` for ``*``;
  the calculator's error message, then a fresh decision). Bad final move: a copy error.
- ``arithmetic``: single turn; the answer, or a near miss.

    python scripts/make_chat_sft_data.py --out chat_sft.jsonl \\
        --guess-number 4000 --tool-calc 4000 --arithmetic 4000 --quality 0.5

Each JSONL line: ``{"messages", "env", "row", "return", "success"}`` (``algo.data_path`` reads
``messages``; the rest is for inspection and replay).
"""

from __future__ import annotations

import argparse
import json
import random
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from rlhf_lightning.envs.arithmetic import ArithmeticEnv
from rlhf_lightning.envs.base import TextEnv
from rlhf_lightning.envs.guess_number import GuessNumberEnv
from rlhf_lightning.envs.tool_calc import ToolCalcEnv, find_call, safe_eval

Message = dict[str, str]
# A scripted policy: (conversation so far, ending with a user turn; rng) -> the assistant's reply.
Policy = Callable[[list[Message], random.Random], str]

# Harness turn limits of conf/env/{guess_number,tool_calc,arithmetic}.yaml.
MAX_TURNS = {"guess_number": 5, "tool_calc": 4, "arithmetic": 1}
_QUESTION = re.compile(r"What is (.+?)\? You may call a calculator")
_RESULT = re.compile(r"RESULT: (-?\d+)$")


def play(
    env: TextEnv, row: int, policy: Policy, rng: random.Random, max_turns: int
) -> tuple[list[Message], list[float], list[dict[str, Any]]]:
    """One episode of ``env`` at train row ``row``, as the harness plays it (at most ``max_turns``
    replies). Returns the dialogue (without the final observation), the rewards and infos per turn.
    An observation that is a message list (a tool env's tool results) joins the dialogue as it is."""
    obs, _ = env.reset(seed=row, row_index=row)
    if not isinstance(obs, str):
        raise TypeError(f"{type(env).__name__}.reset returned a message list; expected a string")
    messages = [{"role": "user", "content": obs}]
    rewards: list[float] = []
    infos: list[dict[str, Any]] = []
    for _ in range(max_turns):
        reply = policy(messages, rng)
        messages.append({"role": "assistant", "content": reply})
        obs, reward, terminated, truncated, info = env.step(reply)
        rewards.append(float(reward))
        infos.append(info)
        if terminated or truncated or len(rewards) == max_turns:
            break
        messages += obs if isinstance(obs, list) else [{"role": "user", "content": str(obs)}]
    return messages, rewards, infos


def _record(
    env: str, row: int, played: tuple[list[Message], list[float], list[dict[str, Any]]], key: str
) -> dict[str, Any]:
    messages, rewards, infos = played
    return {
        "messages": messages,
        "env": env,
        "row": row,
        "return": round(sum(rewards), 6),
        "success": bool(infos[-1].get(key, False)),
    }


def _rng(seed: int, env: str, row: int) -> random.Random:
    return random.Random(f"chat-sft:{seed}:{env}:{row}")


# ---------------------------------------------------------------------------------------------
# guess_number


def consistent_interval(messages: list[Message], low: int, high: int) -> tuple[int, int]:
    """The numbers still possible after the "Higher." / "Lower." feedback in ``messages``."""
    lo, hi = low, high
    for guess_msg, feedback in zip(messages[1::2], messages[2::2]):
        try:
            guess = int(guess_msg["content"])
        except ValueError:
            continue
        if feedback["content"] == "Higher.":
            lo = max(lo, guess + 1)
        elif feedback["content"] == "Lower.":
            hi = min(hi, guess - 1)
    return lo, hi


def guess_number_policy(quality: float, low: int = 1, high: int = 20) -> Policy:
    """Guess uniformly within the consistent interval with probability ``quality``; otherwise 1-3
    outside it: a repeat or a guess contradicting the feedback, in range when there is one (there
    is none before any feedback: then out of range, never negative, which the env calls invalid)."""

    def policy(messages: list[Message], rng: random.Random) -> str:
        lo, hi = consistent_interval(messages, low, high)
        if rng.random() < quality:
            return str(rng.randint(lo, hi))
        off = [*range(max(0, lo - 3), lo), *range(hi + 1, hi + 4)]
        in_range = [n for n in off if low <= n <= high]
        return str(rng.choice(in_range or off))

    return policy


def guess_number_dialogues(
    n: int,
    quality: float,
    seed: int = 0,
    first_row: int = 0,
    env_kwargs: Mapping[str, Any] | None = None,
    max_turns: int = MAX_TURNS["guess_number"],
) -> list[dict[str, Any]]:
    """``n`` episodes of :class:`GuessNumberEnv` on train rows ``first_row ...``; see the module doc."""
    kwargs = {"max_turns": max_turns, **(env_kwargs or {})}
    env = GuessNumberEnv(**kwargs)
    policy = guess_number_policy(quality, env.low, env.high)
    rows = range(first_row, first_row + n)
    return [
        _record("guess_number", r, play(env, r, policy, _rng(seed, "guess_number", r), max_turns), "solved")
        for r in rows
    ]


# ---------------------------------------------------------------------------------------------
# tool_calc


def near_miss(answer: int, rng: random.Random) -> int:
    """A plausible wrong number: off by 1-9 or by tens, or two digits swapped."""
    s = str(abs(answer))
    kind = rng.random()
    if kind < 0.3 and len(s) >= 2 and len(set(s)) > 1:
        i = rng.randrange(len(s) - 1)
        while s[i] == s[i + 1]:
            i = (i + 1) % (len(s) - 1)
        wrong = int(s[:i] + s[i + 1] + s[i] + s[i + 2 :]) * (-1 if answer < 0 else 1)
    elif kind < 0.65:
        wrong = answer + rng.choice([-1, 1]) * rng.randint(1, 9)
    else:
        wrong = answer + rng.choice([-1, 1]) * 10 * rng.randint(1, 9)
    return wrong if wrong != answer else answer + 1


def _last_call(messages: list[Message]) -> str | None:
    return find_call(messages[-2]["content"]) if len(messages) >= 2 else None


def tool_calc_policy(quality: float, direct_correct: float = 0.1) -> Policy:
    """Scripted :class:`ToolCalcEnv` player (see the module doc). It reads the expression from the
    question; ``direct_correct``: chance that a direct answer (no call) is right."""

    def policy(messages: list[Message], rng: random.Random) -> str:
        question = _QUESTION.search(messages[0]["content"])
        if question is None:
            raise ValueError(f"not a tool_calc question: {messages[0]['content']!r}")
        expr = question.group(1)
        a, op_ab, b, op_c, c = expr.split()
        answer = safe_eval(expr)
        good = rng.random() < quality
        result = _RESULT.match(messages[-1]["content"]) if len(messages) > 1 else None
        call = _last_call(messages)
        if result is not None and call is not None:
            value = int(result.group(1))
            if call == f"{a} {op_ab} {b}":  # the partial product: finish it, or answer it as is
                return f"CALC({value} {op_c} {c})" if good else f"ANSWER: {value}"
            return f"ANSWER: {value if good else near_miss(value, rng)}"  # or miscopy the result
        if good:
            return f"CALC({expr})"
        first = len(messages) == 1  # after a calculator error, no second malformed call
        moves = ["direct", "partial", "malformed"] if first else ["direct", "partial"]
        move = rng.choices(moves, [0.5, 0.3, 0.2] if first else [0.6, 0.4])[0]
        if move == "direct":
            guess = answer if rng.random() < direct_correct else near_miss(answer, rng)
            return f"ANSWER: {guess}"
        if move == "partial":
            return f"CALC({a} {op_ab} {b})"
        return f"CALC({a} x {b} {op_c} {c})"

    return policy


def tool_calc_dialogues(
    n: int,
    quality: float,
    seed: int = 0,
    first_row: int = 0,
    env_kwargs: Mapping[str, Any] | None = None,
    max_turns: int = MAX_TURNS["tool_calc"],
    direct_correct: float = 0.1,
) -> list[dict[str, Any]]:
    """``n`` episodes of :class:`ToolCalcEnv` on train rows ``first_row ...``; see the module doc."""
    env = ToolCalcEnv(**(env_kwargs or {}))
    policy = tool_calc_policy(quality, direct_correct)
    rows = range(first_row, first_row + n)
    return [
        _record("tool_calc", r, play(env, r, policy, _rng(seed, "tool_calc", r), max_turns), "correct")
        for r in rows
    ]


# ---------------------------------------------------------------------------------------------
# arithmetic


def arithmetic_dialogues(
    n: int,
    quality: float = 1.0,
    seed: int = 0,
    first_row: int = 0,
    env_kwargs: Mapping[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """``n`` single-turn :class:`ArithmeticEnv` problems (train split): the bare answer with
    probability ``quality``, else a near miss (the format ``model=tiny`` was trained on)."""
    env = ArithmeticEnv(**(env_kwargs or {}))

    def policy(messages: list[Message], rng: random.Random) -> str:
        assert env.problem is not None  # play() has reset it
        answer = env.problem.answer
        return str(answer if rng.random() < quality else max(0, near_miss(answer, rng)))

    rows = range(first_row, first_row + n)
    return [
        _record("arithmetic", r, play(env, r, policy, _rng(seed, "arithmetic", r), 1), "correct")
        for r in rows
    ]


# ---------------------------------------------------------------------------------------------
# the mix

GENERATORS: dict[str, Callable[..., list[dict[str, Any]]]] = {
    "guess_number": guess_number_dialogues,
    "tool_calc": tool_calc_dialogues,
    "arithmetic": arithmetic_dialogues,
}
DEFAULT_QUALITY = {"guess_number": 0.6, "tool_calc": 0.5, "arithmetic": 1.0}


def chat_sft_mix(
    counts: Mapping[str, int],
    quality: Mapping[str, float] | None = None,
    seed: int = 0,
    first_row: int = 0,
) -> list[dict[str, Any]]:
    """Dialogues of every env in ``counts`` (``{"guess_number": 4000, ...}``), shuffled with
    ``seed``. ``quality``: per env, defaults :data:`DEFAULT_QUALITY`. Deterministic in its arguments."""
    unknown = sorted(set(counts) - set(GENERATORS) | set(quality or {}) - set(GENERATORS))
    if unknown:
        raise ValueError(f"unknown env(s) {unknown}; choose from {sorted(GENERATORS)}")
    q = {**DEFAULT_QUALITY, **(quality or {})}
    rows: list[dict[str, Any]] = []
    for name, n in counts.items():
        rows += GENERATORS[name](n, q[name], seed=seed, first_row=first_row)
    random.Random(f"chat-sft-shuffle:{seed}").shuffle(rows)
    return rows


def success_rates(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Fraction of successful episodes per env."""
    by_env: dict[str, list[bool]] = {}
    for r in rows:
        by_env.setdefault(r["env"], []).append(r["success"])
    return {env: sum(s) / len(s) for env, s in sorted(by_env.items())}


def write_jsonl(rows: list[dict[str, Any]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--first-row", type=int, default=0, help="first train row of each env")
    ap.add_argument("--guess-number", type=int, default=4000, help="number of dialogues")
    ap.add_argument("--tool-calc", type=int, default=4000)
    ap.add_argument("--arithmetic", type=int, default=4000)
    ap.add_argument("--quality", type=float, default=None, help="guess_number and tool_calc quality")
    ap.add_argument("--arithmetic-quality", type=float, default=DEFAULT_QUALITY["arithmetic"])
    args = ap.parse_args()
    quality = {"arithmetic": args.arithmetic_quality}
    if args.quality is not None:
        quality |= {"guess_number": args.quality, "tool_calc": args.quality}
    counts = {"guess_number": args.guess_number, "tool_calc": args.tool_calc, "arithmetic": args.arithmetic}
    rows = chat_sft_mix({k: n for k, n in counts.items() if n > 0}, quality, args.seed, args.first_row)
    write_jsonl(rows, args.out)
    rates = ", ".join(f"{env} {rate:.2f}" for env, rate in success_rates(rows).items())
    print(f"wrote {len(rows)} dialogues to {args.out}; success: {rates}")


if __name__ == "__main__":
    main()
