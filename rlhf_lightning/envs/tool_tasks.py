"""Concrete tool-calling tasks on :class:`~rlhf_lightning.envs.tools.ToolEnv`.

- :class:`CalculatorToolEnv` (``env=tools``): the ``a * b +- c`` problems of ``env=tool_calc``
  (same rows for the same seed), with a real ``calculator(expression)`` tool called through
  the chat template instead of ``CALC(...)`` text.
- :class:`AddLookupToolEnv`: a small two-tool task (``add``, ``lookup``) for tests and examples.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from decimal import Decimal, localcontext
from fractions import Fraction
from typing import Any

from rlhf_lightning.envs.arithmetic import final_integer
from rlhf_lightning.envs.tool_calc import (
    MAX_EXPR_CHARS,
    MAX_OPERAND_DIGITS,
    MAX_RESULT,
    CalcError,
    ToolCalcEnv,
)
from rlhf_lightning.envs.tools import ToolEnv

_BINARY = {"+": 1, "-": 1, "*": 2, "/": 2}
_NEG_PRECEDENCE = 3
RESULT_DIGITS = 12  # significant digits of a result that is not a whole number


def _apply(op: str, values: list[Fraction]) -> None:
    if op == "neg":
        values[-1] = -values[-1]
        return
    b, a = values.pop(), values.pop()
    if op == "/" and b == 0:
        raise CalcError("division by zero")
    result = a + b if op == "+" else a - b if op == "-" else a * b if op == "*" else a / b
    if abs(result.numerator) >= MAX_RESULT or result.denominator >= MAX_RESULT:
        raise CalcError("result too large")
    values.append(result)


def _precedence(op: str) -> int:
    return _NEG_PRECEDENCE if op == "neg" else _BINARY[op]


def _reduce(values: list[Fraction], ops: list[str], min_precedence: int) -> None:
    """Apply stacked operators down to the innermost ``(`` while they bind at least as tightly."""
    while ops and ops[-1] != "(" and _precedence(ops[-1]) >= min_precedence:
        _apply(ops.pop(), values)


def _tokens(expr: str) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(expr):
        ch = expr[i]
        if ch.isspace():
            i += 1
        elif ch.isascii() and ch.isdigit():
            j = i
            while j < len(expr) and expr[j].isascii() and expr[j].isdigit():
                j += 1
            out.append(expr[i:j])
            i = j
        else:
            out.append(ch)
            i += 1
    return out


def evaluate(expr: str) -> Fraction:
    """The exact value of an integer expression of ``+ - * /``, unary ``-`` and parentheses.

    Never ``eval``: operator precedence with two stacks and no recursion, so neither a long nor
    a deeply nested expression exhausts the stack. Raises :class:`CalcError` (a ``ValueError``)
    on anything else, on division by zero, on an expression over ``MAX_EXPR_CHARS`` characters,
    an operand of ``MAX_OPERAND_DIGITS`` digits or more, and a numerator or denominator of
    ``MAX_RESULT`` or more.
    """
    if len(expr) > MAX_EXPR_CHARS:
        raise CalcError(f"expression longer than {MAX_EXPR_CHARS} characters")
    values: list[Fraction] = []
    ops: list[str] = []
    expect_operand = True
    for token in _tokens(expr):
        if expect_operand:
            if token.isdigit():
                if len(token.lstrip("0")) > MAX_OPERAND_DIGITS:
                    raise CalcError(f"numbers must be below 10**{MAX_OPERAND_DIGITS}")
                values.append(Fraction(int(token)))
                expect_operand = False
            elif token in ("-", "("):
                ops.append("neg" if token == "-" else "(")
            else:
                raise CalcError(f"unexpected {token!r}")
        elif token in _BINARY:
            _reduce(values, ops, _BINARY[token])  # left-associative
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


def format_number(value: Fraction) -> str:
    """A whole number exactly; anything else as a decimal of ``RESULT_DIGITS`` significant digits."""
    if value.denominator == 1:
        return str(value.numerator)
    with localcontext() as ctx:
        ctx.prec = RESULT_DIGITS
        return str((Decimal(value.numerator) / Decimal(value.denominator)).normalize())


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: integers with + - * / and parentheses, e.g. "(12 + 3) * 4"
    """
    return format_number(evaluate(expression))


def calc_problem(seed: int, row_index: int | None, evaluation: bool) -> tuple[str, int]:
    """``env=tool_calc``'s problem of this row: its expression (``a * b +- c``) and answer."""
    env = ToolCalcEnv(seed=seed)
    prompt, _ = env.reset(seed=row_index, row_index=row_index, evaluation=evaluation)
    assert env.answer is not None
    return prompt.removeprefix("What is ").split("?", 1)[0], env.answer


class CalculatorToolEnv(ToolEnv):
    """What is ``a * b +- c``? (``env=tool_calc``'s rows) with a ``calculator`` tool.

    The final answer (a reply with no tool call) scores 1.0 when its last integer is the
    answer, else 0.0; the rest (tool calls, limits, shaping) is :class:`ToolEnv`'s.

    Args:
        seed, train_size, eval_size: the problems, as in ``ToolCalcEnv``.
        tools: default ``[calculator]``; dotted paths work (``env.kwargs.tools``).
        **tool_env: ``parser``, ``max_tool_calls``, ``tool_timeout_s``, ``call_reward``,
            ``error_penalty``, ``max_result_chars``, ``tool_workers`` (see :class:`ToolEnv`).
    """

    def __init__(
        self,
        seed: int = 0,
        train_size: int = 100_000,
        eval_size: int = 200,
        tools: Sequence[Callable[..., Any] | str] | None = None,
        parser: str = "hermes",
        max_tool_calls: int = 3,
        tool_timeout_s: float | None = 5.0,
        call_reward: float = 0.0,
        error_penalty: float = 0.0,
        max_result_chars: int = 2000,
        tool_workers: int = 2,
    ) -> None:
        super().__init__(
            tools if tools is not None else [calculator],
            parser=parser,
            max_tool_calls=max_tool_calls,
            tool_timeout_s=tool_timeout_s,
            call_reward=call_reward,
            error_penalty=error_penalty,
            max_result_chars=max_result_chars,
            tool_workers=tool_workers,
        )
        self.seed, self.train_size, self.eval_size = seed, train_size, eval_size
        self.answer: int | None = None

    def num_rows(self, evaluation: bool) -> int:
        return self.eval_size if evaluation else self.train_size

    def new_task(
        self, seed: int | None, row_index: int | None, evaluation: bool
    ) -> tuple[str, dict[str, Any]]:
        expr, self.answer = calc_problem(self.seed, row_index if row_index is not None else seed, evaluation)
        prompt = f"What is {expr}? Use the calculator tool if it helps, then reply with the number."
        return prompt, {}

    def score_answer(self, reply: str) -> float:
        return float(final_integer(reply) == self.answer)


TABLE = {"apple": 12, "pear": 7, "plum": 30, "fig": 5, "kiwi": 18}


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    return a + b


def lookup(key: str) -> str:
    """The value stored under a key.

    Args:
        key: a fruit name, e.g. "apple"
    """
    if key not in TABLE:
        raise LookupError(f"no entry {key!r}; keys: {', '.join(TABLE)}")
    return str(TABLE[key])


class AddLookupToolEnv(ToolEnv):
    """What is the value stored under ``key`` plus ``n``? Tools: ``add`` and ``lookup``.

    The final answer scores 1.0 when its last integer is ``TABLE[key] + n``, else 0.0.
    ``tools`` (default ``[add, lookup]``) and the other arguments are :class:`ToolEnv`'s.
    """

    def __init__(
        self, seed: int = 0, tools: Sequence[Callable[..., Any] | str] | None = None, **tool_env: Any
    ) -> None:
        super().__init__(tools if tools is not None else [add, lookup], **tool_env)
        self.seed = seed
        self.answer: int | None = None

    def num_rows(self, evaluation: bool) -> int:
        return 20 if evaluation else 1000

    def new_task(
        self, seed: int | None, row_index: int | None, evaluation: bool
    ) -> tuple[str, dict[str, Any]]:
        row = row_index if row_index is not None else seed
        rng = random.Random(f"{self.seed}:{'eval' if evaluation else 'train'}:{row}")
        key, n = rng.choice(sorted(TABLE)), rng.randint(1, 50)
        self.answer = TABLE[key] + n
        return f"What is the value stored under {key} plus {n}?", {"key": key, "n": n}

    def score_answer(self, reply: str) -> float:
        return float(final_integer(reply) == self.answer)
