"""math-verify's check of one answer, as run in a worker process by
:func:`rlhf_lightning.envs.math.verify`.

Importing this module imports nothing heavy (the parent process never needs math-verify or
sympy). The worker gets the check as :data:`EQUIVALENT`, whose unpickling imports math-verify:
a worker does that while it takes up its first call, which counts against the worker's start
limit (``START_TIMEOUT_S``), not against the check's deadline (math-verify's import takes
seconds on a loaded machine: a fresh worker's first check would otherwise run out of time).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any


def equivalent(completion: str, gold: str, timeout_s: float) -> bool:
    """Whether math-verify finds the completion's final answer equal to ``gold``.

    Runs on a worker's main thread, where math-verify's own ``signal.alarm`` timeouts work:
    parsing each side and comparing them are each stopped after ``ceil(timeout_s)`` seconds
    (then the answer counts as not equal). Sympy work those timers cannot interrupt (one
    enormous integer power) is bounded by the caller's deadline on the whole call.
    """
    from math_verify import parse
    from math_verify import verify as mv_verify

    limit = max(1, math.ceil(timeout_s))
    gold_parsed = parse(gold if "$" in gold or "\\boxed" in gold else f"${gold}$", parsing_timeout=limit)
    answer = parse(completion, parsing_timeout=limit)
    return bool(gold_parsed) and bool(answer) and bool(mv_verify(gold_parsed, answer, timeout_seconds=limit))


def _equivalent_with_math_verify() -> Callable[[str, str, float], bool]:
    """:func:`equivalent`, with math-verify imported (what unpickling :data:`EQUIVALENT` calls)."""
    import math_verify  # noqa: F401  (with sympy: the slow part, done before the call starts)

    return equivalent


class _Equivalent:
    """:func:`equivalent` as a picklable stand-in: it pickles as "import math-verify, then give
    :func:`equivalent`", so a worker unpickles it into the function itself."""

    def __call__(self, completion: str, gold: str, timeout_s: float) -> bool:
        return equivalent(completion, gold, timeout_s)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_equivalent_with_math_verify, ())


EQUIVALENT = _Equivalent()
