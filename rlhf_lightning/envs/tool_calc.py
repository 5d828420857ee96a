"""Multi-turn tool use: a calculator the model may call before answering."""

from __future__ import annotations

import random
import re
from typing import Any

from rlhf_lightning.envs.arithmetic import final_integer, parse_answer

MAX_EXPR_CHARS = 10_000  # a longer CALC(...) expression is answered with a tool error
MAX_OPERAND_DIGITS = 9  # operands are below 10**9
MAX_RESULT = 10**100  # every intermediate result stays below this in absolute value

_CALL = re.compile(r"CALC\s*\(")
_ANSWER = re.compile(r"ANSWER\s*(?::\s*)?(-?\d+)")  # one way to match: no quadratic backtracking
_TOKEN = re.compile(r"[0-9]+|\S")
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "neg": 3}  # "neg": unary minus


class CalcError(ValueError):
    """An expression the calculator refuses; the message is shown to the model."""


def find_call(action: str) -> str | None:
    """The expression inside the first ``CALC(...)`` of ``action`` (parentheses balanced), or
    None when there is none or it is never closed. One pass: linear in ``len(action)``."""
    start = _CALL.search(action)
    if start is None:
        return None
    depth = 1
    for paren in re.finditer(r"[()]", action[start.end() :]):
        depth += 1 if paren.group() == "(" else -1
        if depth == 0:
            return action[start.end() : start.end() + paren.start()]
    return None


def _apply(op: str, values: list[int]) -> None:
    if op == "neg":
        values[-1] = -values[-1]
        return
    b, a = values.pop(), values.pop()
    result = a + b if op == "+" else a - b if op == "-" else a * b
    if abs(result) >= MAX_RESULT:
        raise CalcError("result too large")
    values.append(result)


def _reduce(values: list[int], ops: list[str], min_precedence: int) -> None:
    """Apply the stacked operators down to the innermost ``(`` while they bind at least as tightly."""
    while ops and ops[-1] != "(" and _PRECEDENCE[ops[-1]] >= min_precedence:
        _apply(ops.pop(), values)


def _push_operand(token: str, values: list[int], ops: list[str]) -> bool:
    """Handle a token where an operand is expected; True when an operand is still expected."""
    if token.isascii() and token.isdigit():
        if len(token.lstrip("0")) > MAX_OPERAND_DIGITS:
            raise CalcError(f"numbers must be below 10**{MAX_OPERAND_DIGITS}")
        values.append(int(token))
        return False
    if token in ("-", "("):
        ops.append("neg" if token == "-" else "(")
        return True
    raise CalcError(f"unexpected {token!r}")


def safe_eval(expr: str) -> int:
    """Evaluate an integer expression of ``+ - *``, unary ``-`` and parentheses, nothing else.

    Operator precedence with two stacks and no recursion, so neither a long nor a deeply nested
    expression can exhaust the stack; raises :class:`CalcError` (a ``ValueError``) on anything
    else, on an expression over ``MAX_EXPR_CHARS`` characters and on a result of ``MAX_RESULT`` or more.
    """
    if len(expr) > MAX_EXPR_CHARS:
        raise CalcError(f"expression longer than {MAX_EXPR_CHARS} characters")
    values: list[int] = []
    ops: list[str] = []
    expect_operand = True
    for token in _TOKEN.findall(expr):
        if expect_operand:
            expect_operand = _push_operand(token, values, ops)
        elif token in ("+", "-", "*"):
            _reduce(values, ops, _PRECEDENCE[token])  # left-associative
            ops.append(token)
            expect_operand = True
        elif token == ")":
            _reduce(values, ops, 0)
            if not ops:
                raise CalcError("unbalanced ')'")
            ops.pop()
        else:
            raise CalcError(f"unexpected {token!r}")
    if expect_operand:
        raise CalcError("incomplete expression")
    _reduce(values, ops, 0)
    if ops:
        raise CalcError("unbalanced '('")
    return values[0]


class ToolCalcEnv:
    """Arithmetic that is hard to do in one's head, with a calculator tool.

    The model may reply ``CALC(<expression>)`` (integers, ``+ - *``, parentheses); the env
    answers ``RESULT: <value>`` as the next user turn. Any other reply is the final answer: the
    integer after ``ANSWER:`` if present, else the last integer. Reward ``1.0`` for a correct final
    answer, ``-tool_penalty`` per calculator call (so unneeded calls cost), 0 otherwise; at most
    ``max_calls`` calls. ``info``: ``calls``, ``correct``.
    """

    def __init__(
        self,
        seed: int = 0,
        max_calls: int = 3,
        tool_penalty: float = 0.0,
        train_size: int = 100_000,
        eval_size: int = 200,
    ) -> None:
        self.seed, self.max_calls, self.tool_penalty = seed, max_calls, tool_penalty
        self.train_size, self.eval_size = train_size, eval_size
        self.answer: int | None = None
        self.calls = 0

    def num_rows(self, evaluation: bool) -> int:
        return self.eval_size if evaluation else self.train_size

    def reset(
        self, seed: int | None = None, *, row_index: int | None = None, evaluation: bool = False
    ) -> tuple[str, dict[str, Any]]:
        rng = random.Random(
            f"{self.seed}:{'eval' if evaluation else 'train'}:{row_index if row_index is not None else seed}"
        )
        a, b, c = rng.randint(12, 99), rng.randint(12, 99), rng.randint(2, 99)
        expr = f"{a} * {b} + {c}" if rng.random() < 0.5 else f"{a} * {b} - {c}"
        self.answer = safe_eval(expr)
        self.calls = 0
        prompt = (
            f"What is {expr}? You may call a calculator by replying CALC(expression); "
            "reply ANSWER: <number> when you know the result."
        )
        return prompt, {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.answer is None:
            raise RuntimeError("ToolCalcEnv.step called before reset")
        answer = _ANSWER.search(action)
        expr = None if answer else find_call(action)
        if expr is not None and self.calls < self.max_calls:
            self.calls += 1
            info = {"calls": self.calls, "correct": False}
            return calculator_reply(expr), -self.tool_penalty, False, False, info
        final = parse_answer(answer.group(1)) if answer else final_integer(action)
        correct = final == self.answer
        return "", float(correct), True, False, {"calls": self.calls, "correct": correct}


def calculator_reply(expr: str) -> str:
    """The env's answer to ``CALC(expr)``: the value, or what was wrong with the expression."""
    try:
        return f"RESULT: {safe_eval(expr)}"
    except CalcError as err:
        return f"RESULT: error: {err} (use integers, + - * and parentheses)"
