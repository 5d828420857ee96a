"""Single-turn math problems from a local JSONL or Parquet file, scored with math-verify."""

from __future__ import annotations

import functools
import threading
from pathlib import Path
from typing import Any

from rlhf_lightning.config import ASSETS
from rlhf_lightning.envs.files import read_rows, require_columns, split_rows

SAMPLE_FILE = ASSETS / "math_sample.jsonl"


def verify(completion: str, gold: str) -> bool:
    """math-verify's equivalence check of the completion's final answer against the gold answer."""
    try:
        from math_verify import parse
        from math_verify import verify as mv_verify
    except ImportError as err:
        raise ImportError("env=math needs math-verify: pip install 'rlhf_lightning[math]'") from err
    # math-verify's timeouts use signal.alarm, which only works in the main thread.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold_parsed = parse(gold if "$" in gold or "\\boxed" in gold else f"${gold}$", parsing_timeout=timeout)
    answer = parse(completion, parsing_timeout=timeout)
    return bool(gold_parsed) and bool(answer) and mv_verify(gold_parsed, answer, timeout_seconds=timeout)


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
    """

    def __init__(
        self,
        path: str | None = None,
        eval_path: str | None = None,
        question_key: str = "question",
        answer_key: str = "answer",
        eval_fraction: float = 0.25,
        instruction: str = "Put the final answer in \\boxed{}.",
    ) -> None:
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
        correct = verify(action, str(self.row[self.answer_key]))
        return "", float(correct), True, False, {"correct": correct}
