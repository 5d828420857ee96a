"""Reading one split of a dataset (a Hub id, a local dataset directory or a local data file)
for ``env=dataset``, with errors that name the file, what is wrong with it and the fix."""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf_lightning.config.errors import ConfigError

Row = dict[str, Any]
LOCAL_BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv"}
TEXT_FORMATS = (".jsonl", ".json", ".csv")


@dataclass(frozen=True)
class Source:
    """One split of a dataset, as ``load_rows`` reads it."""

    path: str
    name: str | None
    split: str
    revision: str | None
    streaming: bool
    max_rows: int | None

    def rows(self) -> tuple[Row, ...]:
        return load_rows(self.path, self.name, self.split, self.revision, self.streaming, self.max_rows)

    def local_file(self) -> Path | None:
        """The local data file, None for a Hub id or a dataset directory."""
        p = Path(self.path).expanduser()
        return p.resolve() if p.is_file() else None

    def label(self) -> str:
        if self.local_file() is not None:
            return self.path
        return f"split {self.split!r} of {self.path}" + (f" (subset {self.name!r})" if self.name else "")

    def same_rows(self, other: Source) -> bool:
        """Both read the same rows (one file, or one split of one dataset)."""
        mine, theirs = self.local_file(), other.local_file()
        if mine is not None or theirs is not None:
            return mine == theirs and self.max_rows == other.max_rows
        return self == other


def first_invalid_utf8(file: Path) -> tuple[int, int, bytes] | None:
    """(line, byte in that line, the bytes) of the first sequence that is not UTF-8, else None.

    Line by line: a newline is never inside a multi-byte sequence, so each line decodes alone.
    """
    with file.open("rb") as f:
        for number, line in enumerate(f, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as err:
                return number, err.start, line[err.start : err.end + 3]
    return None


def is_blank(file: Path) -> bool:
    """The file is empty or (if small) only whitespace."""
    size = file.stat().st_size
    return size == 0 or (size < 1 << 16 and not file.read_bytes().strip())


def load_error(path: str, file: Path | None, split: str, name: str | None, err: Exception) -> ConfigError:
    """What went wrong loading ``path``, with the fix: an encoding, an unreadable local file, or
    a dataset (directory or Hub id) that does not load."""
    if file is None:
        hint = (
            "Check the split names (env.kwargs.split, eval_split; null holds out eval rows)"
            if Path(path).expanduser().is_dir()
            else "Without the Hugging Face Hub, download it elsewhere and point env.kwargs.path at the local files"
        )
        subset = f", subset {name!r}" if name else ""
        return ConfigError(
            "env.kwargs.path",
            path,
            f"a dataset that loads with datasets.load_dataset (split {split!r}{subset}): "
            f"{type(err).__name__}: {err}. {hint}",
        )
    chain: list[BaseException] = []
    cause: BaseException | None = err
    while cause is not None and cause not in chain:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    encoding = any(
        isinstance(e, UnicodeDecodeError) or re.search(r"utf-?8", str(e), re.IGNORECASE) for e in chain
    )
    where = first_invalid_utf8(file) if encoding and file.suffix in TEXT_FORMATS else None
    if encoding or where is not None:
        at = f" (line {where[0]}, byte {where[1]}: {where[2]!r})" if where else ""
        return ConfigError(
            "env.kwargs.path",
            path,
            f"a UTF-8 encoded file: {file} is not valid UTF-8{at}. Convert it to UTF-8, e.g. "
            f"iconv -f latin1 -t utf-8 {file.name} > utf8{file.suffix} (latin-1 source), or "
            "re-save it from pandas with encoding='utf-8'",
        )
    empty = ("StopIteration", "EmptyDataError")  # an empty JSON-lines file; a CSV without columns
    if any(type(e).__name__ in empty or "corresponds to no data" in str(e) for e in chain):
        return ConfigError("env.kwargs.path", path, f"a data file with rows: {file} has no rows")
    bad = first_invalid_json_line(file) if file.suffix == ".jsonl" else None
    if bad is not None:  # Arrow's message names neither the line nor the JSON error
        return ConfigError(
            "env.kwargs.path",
            path,
            f"a JSON-lines file: line {bad[0]} of {file} is not valid JSON ({bad[1]}); fix or delete that line",
        )
    root = chain[-1]
    return ConfigError(
        "env.kwargs.path",
        path,
        f"a {LOCAL_BUILDERS[file.suffix]} file that datasets.load_dataset reads: {file} fails with "
        f"{type(root).__name__}: {root}. Check that the file is complete and in that format",
    )


def first_invalid_json_line(file: Path) -> tuple[int, str] | None:
    """The first non-blank line (numbered from 1) of a JSON-lines file that is not one JSON
    value, and the parser's message; None when every line parses (or the file is unreadable)."""
    try:
        with file.open(encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if line.strip():
                    try:
                        json.loads(line.rstrip("\r\n"))
                    except json.JSONDecodeError as err:
                        return number, f"{err.msg}, column {err.colno}"
    except (OSError, UnicodeDecodeError):
        return None
    return None


@functools.lru_cache(maxsize=8)
def load_rows(
    path: str, name: str | None, split: str, revision: str | None, streaming: bool, max_rows: int | None
) -> tuple[Row, ...]:
    """The rows of one split, loaded once per process (every episode builds its own env).

    ``path`` is a local ``.parquet``/``.jsonl``/``.json``/``.csv`` file, a local dataset
    directory, or a Hub id. With ``streaming`` only the first ``max_rows`` rows are read.
    A local file has one split: ``split`` only labels it.
    """
    try:
        import datasets
    except ImportError as err:  # a core dependency; only a broken install lacks it
        raise ImportError("env=dataset needs the datasets package: pip install datasets") from err
    if streaming and max_rows is None:
        raise ConfigError("env.kwargs.max_rows", None, "a row count: streaming reads only that many rows")
    local = Path(path).expanduser()
    kwargs: dict[str, Any] = {"split": split, "streaming": streaming}
    file = local if local.is_file() else None
    if file is not None:
        if local.suffix not in LOCAL_BUILDERS:
            raise ConfigError("env.kwargs.path", path, f"a file ending in one of {sorted(LOCAL_BUILDERS)}")
        if is_blank(local):
            raise ConfigError("env.kwargs.path", path, f"a data file with rows: {local} is empty")
        args: tuple[str, ...] = (LOCAL_BUILDERS[local.suffix],)
        kwargs.update(data_files={split: str(local)})
    elif not local.exists() and (local.suffix in LOCAL_BUILDERS or path.startswith(("/", ".", "~"))):
        raise ConfigError("env.kwargs.path", path, "an existing file or directory: there is none")
    else:
        args = (str(local) if local.is_dir() else path, *([name] if name else []))
        kwargs["revision"] = revision
    try:  # reading the rows is in here too: some decoding errors only show up then
        ds = datasets.load_dataset(*args, **kwargs)
        if streaming:
            return tuple(dict(row) for row in ds.take(max_rows))
        rows = ds if max_rows is None else ds.select(range(min(max_rows, len(ds))))
        return tuple(rows.to_list())
    except ConfigError:
        raise
    except Exception as err:
        raise load_error(path, file, split, name, err) from None
