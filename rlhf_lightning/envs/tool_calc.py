"""Multi-turn tool use: a calculator the model may call before answering."""

from __future__ import annotations

import ast
import operator
import random
import re
from typing import Any

from rlhf_lightning.envs.arithmetic import final_integer

_CALL = re.compile(r"CALC\s*\(([^)]*)\)")
_ANSWER = re.compile(r"ANSWER\s*:?\s*(-?\d+)")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def safe_eval(expr: str) -> int:
    """Evaluate an integer expression of + - * and parentheses, nothing else."""

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and abs(node.value) < 10**9:
            return node.value
        raise ValueError(f"unsupported expression: {expr!r}")

    return walk(ast.parse(expr.strip(), mode="eval"))


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
        call = _CALL.search(action)
        if call and not _ANSWER.search(action) and self.calls < self.max_calls:
            self.calls += 1
            try:
                result = f"RESULT: {safe_eval(call.group(1))}"
            except (ValueError, SyntaxError):
                result = "RESULT: error (use integers, + - * and parentheses)"
            return result, -self.tool_penalty, False, False, {"calls": self.calls, "correct": False}
        m = _ANSWER.search(action)
        final = int(m.group(1)) if m else final_integer(action)
        correct = final == self.answer
        return "", float(correct), True, False, {"calls": self.calls, "correct": correct}
