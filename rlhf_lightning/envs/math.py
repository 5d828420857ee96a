"""Single-turn math problems from a local JSONL or Parquet file, scored with math-verify."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from rlhf_lightning.config import ASSETS

SAMPLE_FILE = ASSETS / "math_sample.jsonl"


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a ``.jsonl``/``.json`` (one object per line, or a list) or ``.parquet`` file."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(
            f"MathEnv: no such file {str(p)!r}; give env.kwargs.path a local .jsonl or .parquet file"
        )
    if p.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as err:
            raise ImportError("reading .parquet needs pyarrow: pip install pyarrow") from err
        return pq.read_table(p).to_pylist()
    text = p.read_text()
    if p.suffix == ".json" and text.lstrip().startswith("["):
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


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
        rows = read_rows(path or SAMPLE_FILE)
        for i, row in enumerate(rows):
            missing = [k for k in (question_key, answer_key) if k not in row]
            if missing:
                raise KeyError(
                    f"MathEnv: row {i} of {path or SAMPLE_FILE} has no column(s) {missing}; columns: {sorted(row)}"
                )
        if eval_path is not None:
            self.train, self.eval = rows, read_rows(eval_path)
        else:
            cut = max(1, int(len(rows) * (1 - eval_fraction)))
            self.train, self.eval = rows[:cut], rows[cut:]
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
