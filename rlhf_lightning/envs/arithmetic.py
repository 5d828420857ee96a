"""Arithmetic word problems generated from a seed: the default, offline task.

Each row of the train or eval split is one problem, generated deterministically from
``(seed, split, row_index)``. The split is held out by construction: a problem's
``(a, b, op)`` triple falls in the eval split iff its bucket hash is 0, so no eval problem
is ever a train problem.
"""

from __future__ import annotations

import functools
import random
import re
from dataclasses import dataclass
from typing import Any

NAMES = ("Anna", "Ben", "Carl", "Dora", "Emma", "Finn")
ITEMS = ("apples", "books", "coins", "cards", "shells", "stamps")
# (template, operation); {a} and {b} are the operands, the answer is a op b.
TEMPLATES: tuple[tuple[str, str], ...] = (
    ("What is {a} plus {b}?", "+"),
    ("{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?", "+"),
    ("A box holds {a} {item}. {name} puts in {b} more. How many {item} are in the box?", "+"),
    ("What is {a} minus {b}?", "-"),
    ("{name} has {a} {item} and gives away {b}. How many {item} are left?", "-"),
    ("A box holds {a} {item}. {name} takes out {b}. How many {item} are in the box?", "-"),
)
_INT = re.compile(r"-?\d+")
EVAL_BUCKETS = 10  # one problem triple in ten is held out for evaluation
MAX_ANSWER_DIGITS = 100  # a longer number is no answer (and int() refuses > 4300 digits)


@dataclass(frozen=True)
class Problem:
    question: str
    answer: int


def _bucket(a: int, b: int, op: str) -> int:
    return (a * 131 + b * 17 + (7 if op == "+" else 3)) % EVAL_BUCKETS


@functools.lru_cache(maxsize=8192)  # every member of a group resets to the same row
def make_problem(seed: int, row_index: int, evaluation: bool, min_operand: int, max_operand: int) -> Problem:
    """The problem at ``row_index`` of the train (or eval) split: pure, deterministic."""
    rng = random.Random(f"{seed}:{'eval' if evaluation else 'train'}:{row_index}")
    while True:
        template, op = rng.choice(TEMPLATES)
        a, b = rng.randint(min_operand, max_operand), rng.randint(min_operand, max_operand)
        if op == "-" and b > a:
            a, b = b, a
        if (_bucket(a, b, op) == 0) == evaluation:
            break
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    question = template.format(a=a, b=b, name=name, item=item)
    return Problem(question, a + b if op == "+" else a - b)


def parse_answer(digits: str) -> int | None:
    """``digits`` (an optional ``-`` and ASCII or Unicode digits) as an int, or None when it has
    more than :data:`MAX_ANSWER_DIGITS` digits: no task here has such an answer."""
    body = digits.lstrip("-").lstrip("0") or "0"  # leading zeros count towards int()'s limit too
    if len(body) > MAX_ANSWER_DIGITS:
        return None
    return -int(body) if digits.startswith("-") else int(body)


def final_integer(text: str) -> int | None:
    """The last integer in ``text`` (the final answer), or None when there is none."""
    found = _INT.findall(text.replace(",", ""))
    return parse_answer(found[-1]) if found else None


class ArithmeticEnv:
    """Single-turn arithmetic: reset gives a word problem, step scores the reply.

    Reward 1.0 when the final integer of the reply equals the answer (``exact=True``: the
    reply, stripped, must be the answer and nothing else), else 0.0.
    """

    def __init__(
        self,
        seed: int = 0,
        min_operand: int = 10,
        max_operand: int = 99,
        train_size: int = 100_000,
        eval_size: int = 200,
        exact: bool = False,
    ) -> None:
        if not 0 <= min_operand <= max_operand:
            raise ValueError(
                f"ArithmeticEnv: need 0 <= min_operand <= max_operand, got {min_operand} and {max_operand}"
            )
        self.seed, self.min_operand, self.max_operand = seed, min_operand, max_operand
        self.train_size, self.eval_size, self.exact = train_size, eval_size, exact
        self.problem: Problem | None = None

    def num_rows(self, evaluation: bool) -> int:
        return self.eval_size if evaluation else self.train_size

    def reset(
        self, seed: int | None = None, *, row_index: int | None = None, evaluation: bool = False
    ) -> tuple[str, dict[str, Any]]:
        if row_index is None:
            row_index = random.Random(seed).randrange(self.num_rows(evaluation))
        self.problem = make_problem(self.seed, row_index, evaluation, self.min_operand, self.max_operand)
        return self.problem.question, {"answer": self.problem.answer}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.problem is None:
            raise RuntimeError("ArithmeticEnv.step called before reset")
        if self.exact:
            correct = action.strip() == str(self.problem.answer)
        else:
            correct = final_integer(action) == self.problem.answer
        return "", float(correct), True, False, {"correct": correct}
