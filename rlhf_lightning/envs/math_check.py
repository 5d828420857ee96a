"""math-verify's check of one answer, as run in a worker process by
:func:`rlhf_lightning.envs.math.verify`: a module that imports nothing heavy, so a fresh worker
(the replacement of one stopped at its deadline) is ready in a fraction of a second."""

from __future__ import annotations

import math


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
