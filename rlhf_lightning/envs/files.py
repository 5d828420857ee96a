"""Local data files: JSONL, JSON (a list of objects) or Parquet, as a list of row dicts."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any, cast

from rlhf_lightning.config.errors import ConfigError

log = logging.getLogger(__name__)


def read_rows(path: str | Path, field: str = "data path") -> list[dict[str, Any]]:
    """Rows of a ``.jsonl``/``.json`` (one object per line, or a list) or ``.parquet`` file."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(
            f"no such file {str(p)!r} ({field}); give a local .jsonl, .json or .parquet file"
        )
    rows = _read_any(p, field)
    if not rows:
        raise ConfigError(field, str(p), "the file holds no rows; give at least one")
    return rows


def _read_any(p: Path, field: str) -> list[dict[str, Any]]:
    if p.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as err:
            raise ImportError("reading .parquet needs pyarrow: pip install pyarrow") from err
        return cast(list[dict[str, Any]], pq.read_table(p).to_pylist())
    text = _read_text(p, field)
    if p.suffix == ".json" and text.lstrip().startswith("["):
        rows = _parse_json(text, p, field, None)
        for i, row in enumerate(rows):
            _require_object(row, p, field, f"item {i} of the list")
        return cast(list[dict[str, Any]], rows)
    return _read_jsonl(text, p, field)


def _read_text(path: Path, field: str) -> str:
    try:
        return path.read_text(encoding="utf-8")  # JSON is UTF-8
    except UnicodeDecodeError as err:
        raise ConfigError(
            field, str(path), f"not UTF-8 text (byte {err.start}); save the file as UTF-8"
        ) from None


def _parse_json(text: str, path: Path, field: str, line: int | None) -> Any:
    """``json.loads(text)``; an error names the file and the line (``line``: of a JSONL file)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(
            field,
            str(path),
            f"line {line or err.lineno} is not valid JSON ({err.msg}, column {err.colno}); "
            "fix or delete that line",
        ) from None


def _require_object(row: Any, path: Path, field: str, where: str) -> None:
    if not isinstance(row, dict):
        raise ConfigError(
            field, str(path), f'{where} is {json.dumps(row)[:60]}, not a JSON object {{"column": value}}'
        )


def _read_jsonl(text: str, path: Path, field: str) -> list[dict[str, Any]]:
    """One object per line; blank lines are skipped, line numbers start at 1.

    Lines are split on ``\\n`` only (a ``\\r`` before it is JSON whitespace): JSON strings may
    hold U+2028 and other characters that ``str.splitlines`` would also split on.
    """
    rows = []
    for number, line in enumerate(text.split("\n"), start=1):
        if line.strip():
            row = _parse_json(line, path, field, number)
            _require_object(row, path, field, f"line {number}")
            rows.append(row)
    return rows


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


def row_digest(row: Any) -> bytes:
    """A row's content as 16 bytes: BLAKE2b of its JSON with sorted keys (unequal rows collide
    with probability ~2**-128)."""
    text = json.dumps(row, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).digest()  # ASCII: ensure_ascii


def warn_shared_rows(train: Any, held_out: Any, source: str) -> int:
    """Warn when held-out rows also appear among the training rows (duplicate rows in a file, or
    an eval file that repeats training rows): their eval metrics are then not held-out ones.
    Rows compare by content: a 16-byte digest of each training row's JSON is kept, not its text
    (memory grows with the number of rows, not their size). Returns how many held-out rows are
    shared."""
    seen = {row_digest(row) for row in train}
    shared = sum(row_digest(row) in seen for row in held_out)
    if shared:
        log.warning(
            "%d of %d held-out rows (%s) are also training rows (duplicate rows): the eval metrics count "
            "them as held out; remove the duplicates",
            shared,
            len(held_out),
            source,
        )
    return shared
