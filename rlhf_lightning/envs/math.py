"""Single-turn math problems from a local JSONL or Parquet file, scored with math-verify."""

from __future__ import annotations

import functools
import importlib.util
import logging
from pathlib import Path
from typing import Any

from rlhf_lightning.config import ASSETS
from rlhf_lightning.envs.files import read_rows, require_columns, split_rows
from rlhf_lightning.envs.math_check import EQUIVALENT
from rlhf_lightning.runtime.workers import CallTimeout, StartTimeout, WorkerDied, in_worker, shared_pool

SAMPLE_FILE = ASSETS / "math_sample.jsonl"
VERIFY_TIMEOUT_S = 5.0  # math-verify's own limit on parsing each side and on comparing them
VERIFY_WORKERS = 2  # worker processes that run checks (shared by every env of this process)
# In an env step worker (env.step_workers=process) its one step runs at a time: one check worker
# each, not VERIFY_WORKERS (env.concurrency step workers would otherwise start twice as many).
VERIFY_WORKERS_IN_A_WORKER = 1
log = logging.getLogger(__name__)


def verify(completion: str, gold: str, timeout_s: float = VERIFY_TIMEOUT_S) -> bool:
    """math-verify's equivalence check of the completion's final answer against the gold answer.

    The check runs in a reused worker process (:func:`~rlhf_lightning.runtime.workers.shared_pool`
    ``math-verify``; a round trip costs well under a millisecond), never in the caller: sympy
    can spend hours at full CPU, holding the GIL, on an answer such as ``9^9^9^9`` or a gold
    ``10^{10^{10}}-1``, and math-verify's own timeouts (``signal.alarm``) work only on a main
    thread, which env steps on threads and the async rollout thread are not. In the worker,
    math-verify stops a parse or the comparison after ``timeout_s`` (not equal); a check still
    running ``3 * timeout_s + 1`` seconds after it started is stopped with its worker (killed and
    replaced), logged, and counts as not correct. math-verify is imported by the worker as it
    starts (:data:`~rlhf_lightning.envs.math_check.EQUIVALENT`), outside any check's deadline.
    Inside an env step worker process the pool has one worker (:data:`VERIFY_WORKERS_IN_A_WORKER`).
    """
    if not _math_verify_installed():
        raise ImportError("env=math needs math-verify: pip install 'rlhf_lightning[math]'")
    if timeout_s <= 0:
        raise ValueError(f"verify's timeout_s must be > 0 seconds, got {timeout_s}")
    deadline_s = 3 * timeout_s + 1
    size = VERIFY_WORKERS_IN_A_WORKER if in_worker() else VERIFY_WORKERS
    outcome = shared_pool("math-verify", size).call(
        EQUIVALENT, (completion, gold, timeout_s), timeout_s=deadline_s
    )
    if outcome.error is None:
        return bool(outcome.output)
    if not isinstance(outcome.error, CallTimeout | WorkerDied | StartTimeout):
        raise outcome.error
    log.warning(
        "math-verify's check of the answer ...%r against the gold answer %.120r was stopped "
        "(%s: %s): counted as not correct",
        completion[-120:],
        gold,
        type(outcome.error).__name__,
        outcome.error,
    )
    return False


@functools.cache
def _math_verify_installed() -> bool:
    return importlib.util.find_spec("math_verify") is not None


def cached_rows(path: str, field: str) -> list[dict[str, Any]]:
    """The file's rows, read once per process while it is unchanged (every episode builds its own env)."""
    p = Path(path).expanduser()
    stamp = p.stat().st_mtime_ns if p.is_file() else None
    return _read(str(p), stamp, field)


@functools.lru_cache(maxsize=8)
def _read(path: str, stamp: int | None, field: str) -> list[dict[str, Any]]:
    return read_rows(path, field)


class MathEnv:
    """One problem per row; reward 1.0 when math-verify finds the completion's answer equal to
    the gold one (boxed answers, fractions, equivalent expressions), else 0.0.

    Args:
        path: the train file (``.jsonl``/``.json``/``.parquet``); default: the shipped sample.
        eval_path: the eval file; default: the last ``eval_fraction`` of ``path``'s rows.
        question_key, answer_key: the columns holding the problem and the gold answer.
        instruction: appended to each problem (asks for a boxed answer by default).
        verify_timeout_s: math-verify's limit on one check (see :func:`verify`); an answer it
            cannot settle in time counts as not correct.
    """

    def __init__(
        self,
        path: str | None = None,
        eval_path: str | None = None,
        question_key: str = "question",
        answer_key: str = "answer",
        eval_fraction: float = 0.25,
        instruction: str = "Put the final answer in \\boxed{}.",
        verify_timeout_s: float = VERIFY_TIMEOUT_S,
    ) -> None:
        if not verify_timeout_s > 0:
            raise ValueError(f"env.kwargs.verify_timeout_s must be > 0 seconds, got {verify_timeout_s}")
        self.verify_timeout_s = float(verify_timeout_s)
        rows = cached_rows(str(path or SAMPLE_FILE), "env.kwargs.path")
        require_columns(rows, [question_key, answer_key], f"MathEnv file {path or SAMPLE_FILE}")
        eval_rows = cached_rows(eval_path, "env.kwargs.eval_path") if eval_path is not None else None
        self.train, self.eval = split_rows(rows, eval_rows, eval_fraction)
        self.question_key, self.answer_key, self.instruction = question_key, answer_key, instruction
        self.row: dict[str, Any] | None = None

    def num_rows(self, evaluation: bool) -> int:
        return len(self.eval if evaluation else self.train)

    def reset(
        self, seed: int | None = None, *, row_index: int | None = None, evaluation: bool = False
    ) -> tuple[str, dict[str, Any]]:
        rows = self.eval if evaluation else self.train
        self.row = rows[(row_index if row_index is not None else seed or 0) % len(rows)]
        question = str(self.row[self.question_key])
        return (f"{question}\n{self.instruction}" if self.instruction else question), {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.row is None:
            raise RuntimeError("MathEnv.step called before reset")
        correct = verify(action, str(self.row[self.answer_key]), self.verify_timeout_s)
        return "", float(correct), True, False, {"correct": correct}
