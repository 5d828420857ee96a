"""Local data files: JSONL, JSON (a list of objects) or Parquet, as a list of row dicts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_rows(path: str | Path, field: str = "data path") -> list[dict[str, Any]]:
    """Rows of a ``.jsonl``/``.json`` (one object per line, or a list) or ``.parquet`` file."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(
            f"no such file {str(p)!r} ({field}); give a local .jsonl, .json or .parquet file"
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


def split_rows(
    rows: list[dict[str, Any]], eval_rows: list[dict[str, Any]] | None, eval_fraction: float
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Train and eval rows: an explicit eval file, else the last ``eval_fraction`` of ``rows``."""
    if eval_rows is not None:
        return rows, eval_rows
    cut = max(1, int(len(rows) * (1 - eval_fraction)))
    return rows[:cut], rows[cut:]


def require_columns(rows: list[dict[str, Any]], columns: list[str], source: str) -> None:
    for i, row in enumerate(rows):
        missing = [c for c in columns if c not in row]
        if missing:
            raise KeyError(f"row {i} of {source} has no column(s) {missing}; columns: {sorted(row)}")
