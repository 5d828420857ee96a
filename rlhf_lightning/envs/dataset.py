"""Single-turn problems from a Hugging Face ``datasets`` dataset (a Hub id or local files).

    python train.py env=gsm8k                       # openai/gsm8k, main, train -> test
    python train.py env=dataset env.kwargs.path=/data/train.parquet env.kwargs.question_key=prompt

A row is one task: ``reset`` returns its question (and a copy of the row's columns in ``info``,
which ``reward=function`` receives), ``step`` scores the reply against the gold answer, extracted
from the answer column by ``answer_extractor`` (GSM8K's ``#### n``, MATH's last ``\\boxed{}``,
or a function of yours). Every row is checked at start-up; eval rows are never training rows.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.utils import get_object

from rlhf_lightning.envs.arithmetic import final_integer
from rlhf_lightning.envs.math import verify
from rlhf_lightning.errors import ConfigError

Row = dict[str, Any]
LOCAL_BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv"}
TEXT_FORMATS = (".jsonl", ".json", ".csv")
AUTO = "auto"  # eval_split's default: "test", or a hold-out for a single local file
HOLDOUT_KEY = b"rlhf_lightning.holdout.v1"  # the held-out rows' fixed seed (same every run and rank)


def after_hashes(answer: str) -> str:
    """GSM8K's final answer: the text after ``####``, without thousands separators."""
    return answer.rsplit("####", 1)[-1].strip().replace(",", "") if "####" in answer else answer.strip()


def last_boxed(solution: str) -> str:
    """The content of the last ``\\boxed{...}`` (braces balanced), else the whole text."""
    start = solution.rfind("\\boxed{")
    if start < 0:
        return solution.strip()
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(solution)):
        depth += {"{": 1, "}": -1}.get(solution[j], 0)
        if depth == 0:
            return solution[i + 1 : j].strip()
    return solution[i + 1 :].strip()


ANSWER_EXTRACTORS: dict[str, Callable[[str], str]] = {
    "none": lambda answer: answer.strip(),
    "gsm8k": after_hashes,
    "boxed": last_boxed,
}


def get_answer_extractor(name: str) -> Callable[[str], str]:
    """A registered extractor (``none``, ``gsm8k``, ``boxed``) or the dotted path of a function."""
    if name in ANSWER_EXTRACTORS:
        return ANSWER_EXTRACTORS[name]
    try:
        fn = get_object(name)
    except Exception as err:
        raise ConfigError(
            "env.kwargs.answer_extractor",
            name,
            f"one of {sorted(ANSWER_EXTRACTORS)} or the dotted path of a function str -> str ({err})",
        ) from None
    if not callable(fn):
        raise ConfigError("env.kwargs.answer_extractor", name, "a callable str -> str")
    return fn  # type: ignore[no-any-return]


def is_integer(gold: str) -> bool:
    """``gold`` is an integer (what ``scorer=integer`` can match), e.g. ``-12``."""
    return re.fullmatch(r"-?\d+", gold.strip()) is not None


def integer_match(completion: str, gold: str) -> bool:
    """The completion's last integer equals the gold answer (an integer)."""
    value = final_integer(completion)
    return value is not None and is_integer(gold) and value == int(gold)


SCORERS: dict[str, Callable[[str, str], bool]] = {"math_verify": verify, "integer": integer_match}


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


@dataclass(frozen=True)
class Columns:
    """Which columns hold what, and how the gold answer is read and scored."""

    question: str
    answer: str
    system: str | None
    extractor: str
    scorer: str


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
    root = chain[-1]
    return ConfigError(
        "env.kwargs.path",
        path,
        f"a {LOCAL_BUILDERS[file.suffix]} file that datasets.load_dataset reads: {file} fails with "
        f"{type(root).__name__}: {root}. Check that the file is complete and in that format",
    )


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


def holdout(n: int, fraction: float) -> frozenset[int]:
    """The indices of the held-out eval rows among ``n``: ``round(n * fraction)`` of them (at
    least 1, at most ``n - 1``), a fixed pseudo-random subset (rows ordered by a keyed BLAKE2b
    hash of their index), the same in every run, seed and rank and for every Python version."""
    k = min(max(round(n * fraction), 1), n - 1)
    order = sorted(range(n), key=lambda i: hashlib.blake2b(str(i).encode(), key=HOLDOUT_KEY).digest())
    return frozenset(order[:k])


def row_problem(row: Row, columns: Columns) -> str | None:
    """Why ``row`` cannot be a task (a null or empty question, a null answer), else None."""
    for key in (columns.question, columns.answer, columns.system):
        if key and row.get(key) is None:
            return f"{key}=None"
    if not str(row[columns.question]).strip():
        return f"an empty {columns.question}"
    return None


def gold_answer(row: Row, index: int, columns: Columns, extract: Callable[[str], Any], label: str) -> str:
    """The row's gold answer: ``extract`` (``answer_extractor``) of its answer column, a str."""
    answer = str(row[columns.answer])
    try:
        gold = extract(answer)
    except Exception as err:
        raise ConfigError(
            "env.kwargs.answer_extractor",
            columns.extractor,
            f"a function str -> str for every answer: it raised {type(err).__name__}: {err} on row "
            f"{index} of {label} (answer {answer!r:.80})",
        ) from None
    if not isinstance(gold, str):
        raise ConfigError(
            "env.kwargs.answer_extractor",
            columns.extractor,
            f"a function str -> str: answer_extractor must return str, and it returned "
            f"{type(gold).__name__} {gold!r:.80} for row {index} of {label} (answer {answer!r:.80})",
        )
    return gold


@functools.lru_cache(maxsize=8)
def checked_golds(source: Source, columns: Columns) -> tuple[str, ...]:
    """Every row's gold answer, after checking every row once per process: the question and
    answer columns exist and are not null, the gold answer is a non-empty str (an integer for
    ``scorer=integer``). Raises ConfigError with the count of bad rows, the first one and the fix.
    """
    rows = source.rows()
    label = source.label()
    if not rows:
        raise ConfigError("env.kwargs.path", source.path, f"a dataset with rows: {label} has none")
    missing = [k for k in (columns.question, columns.answer, columns.system) if k and k not in rows[0]]
    if missing:
        raise ConfigError(
            "env.kwargs", {"question_key": columns.question, "answer_key": columns.answer},
            f"columns of {label}: {missing} missing, it has {sorted(rows[0])}",
        )  # fmt: skip
    extract = get_answer_extractor(columns.extractor)
    golds: list[str] = []
    bad: list[tuple[int, str]] = []
    for i, row in enumerate(rows):
        problem = row_problem(row, columns)
        gold = "" if problem else gold_answer(row, i, columns, extract, label)
        if problem is None and not gold.strip():
            problem = f"an empty gold answer (from {columns.answer}={str(row[columns.answer])!r:.60})"
        if problem is None and columns.scorer == "integer" and not is_integer(gold):
            problem = f"a gold answer that is not an integer ({gold!r:.40}) for scorer=integer"
        if problem:
            bad.append((i, problem))
        golds.append(gold)
    if bad:
        kinds: dict[str, int] = {}
        for _, problem in bad:
            kind = problem.split(" (", 1)[0]
            kinds[kind] = kinds.get(kind, 0) + 1
        integer = any("scorer=integer" in p for _, p in bad)
        raise ConfigError(
            "env.kwargs.path",
            source.path,
            f"a dataset whose every row has a question ({columns.question!r}) and a gold answer "
            f"({columns.answer!r}): {len(bad)} of {len(rows)} rows of {label} have none "
            f"({'; '.join(f'{n} with {k}' for k, n in kinds.items())}); the first is row "
            f"{bad[0][0]}, with {bad[0][1]}. Drop or fix those rows, or point "
            "env.kwargs.question_key/answer_key/answer_extractor at the right columns"
            + (", or use env.kwargs.scorer=math_verify" if integer else ""),
        )
    return tuple(golds)


@dataclass(frozen=True)
class Split:
    """Checked rows and their gold answers (``golds[i]`` is ``rows[i]``'s)."""

    rows: tuple[Row, ...]
    golds: tuple[str, ...]


@functools.lru_cache(maxsize=8)
def prepared_splits(
    train: Source, evals: Source | None, fraction: float, columns: Columns
) -> tuple[Split, Split]:
    """The checked train and eval rows, once per process; ``evals=None``: hold out ``fraction``
    of the train rows (:func:`holdout`), both parts in file order."""
    golds = checked_golds(train, columns)
    rows = train.rows()
    if evals is not None:
        eval_rows = evals.rows()
        return Split(rows, golds), Split(eval_rows, checked_golds(evals, columns))
    if len(rows) < 2:
        raise ConfigError(
            "env.kwargs.path",
            train.path,
            f"at least 2 rows to hold out eval rows from: {train.label()} has 1",
        )
    held = holdout(len(rows), fraction)
    part = [[i for i in range(len(rows)) if (i in held) == ev] for ev in (False, True)]
    return (
        Split(tuple(rows[i] for i in part[0]), tuple(golds[i] for i in part[0])),
        Split(tuple(rows[i] for i in part[1]), tuple(golds[i] for i in part[1])),
    )


def eval_source(
    train: Source, eval_path: str | None, eval_name: str | None, eval_split: str | None, fraction: float
) -> Source | None:
    """Where the eval rows come from (None: held out of the train rows); ConfigError for
    settings that would evaluate on training rows or ignore one of them (see ``DatasetEnv``)."""
    if eval_split is None or (eval_path is None and train.local_file() is not None):
        if eval_path is not None:
            raise ConfigError(
                "env.kwargs.eval_split", None,
                f"a split of env.kwargs.eval_path={eval_path!r} (or auto): null holds out rows of the "
                "train split and would ignore eval_path; unset one of the two",
            )  # fmt: skip
        if eval_split not in (None, AUTO):
            raise ConfigError(
                "env.kwargs.eval_split", eval_split,
                f"auto or null when env.kwargs.path is one local file ({train.path}) and "
                f"env.kwargs.eval_path is unset: a file has a single split, so {eval_split!r} would be "
                "its training rows. Set env.kwargs.eval_path=FILE to evaluate on other rows, or "
                "eval_split=auto to hold out env.kwargs.eval_fraction of them",
            )  # fmt: skip
        if not 0.0 < fraction < 1.0:
            raise ConfigError(
                "env.kwargs.eval_fraction", fraction, "a fraction in (0, 1) of rows to hold out"
            )
        return None
    split = "test" if eval_split == AUTO else eval_split
    evals = Source(
        eval_path or train.path,
        eval_name or train.name,
        split,
        train.revision,
        train.streaming,
        train.max_rows,
    )
    if evals.same_rows(train):
        raise ConfigError(
            "env.kwargs.eval_split", eval_split,
            f"eval rows other than the training rows: {evals.label()} is the train split itself. Set "
            "env.kwargs.eval_path or another eval_split, or eval_split=null to hold out "
            "env.kwargs.eval_fraction of the train rows",
        )  # fmt: skip
    return evals


class DatasetEnv:
    """One problem per dataset row; reward 1.0 when the reply's answer matches the gold one.

    Where the eval rows come from, so that they are never the training rows:
        - ``eval_path`` set: that dataset (its ``eval_split``; a local file is its one split);
        - ``path`` one local file and no ``eval_path``: ``eval_fraction`` of its rows held out
          (``eval_split`` must stay ``auto`` or null: a file has no other split to name);
        - ``eval_split=null``: ``eval_fraction`` of the train split held out (with no
          ``eval_path``, which it would ignore);
        - otherwise the ``eval_split`` of ``path`` (``auto``: ``test``); the train split itself
          is refused.
    Held-out rows are a fixed pseudo-random ``round(n * eval_fraction)`` of the n rows (keyed
    hash of the row index: the same in every run, seed and rank), both parts kept in file order.

    Every row of both splits is checked once per process at start-up (a non-null question and
    answer, a non-empty str gold answer, an integer one for ``scorer=integer``); bad rows are
    counted and refused, with the first one shown.

    Args:
        path: Hub id, local data file or dataset directory (``datasets.load_dataset``).
        name: the subset (``load_dataset``'s ``name``, e.g. GSM8K's ``main``).
        split, eval_split: the train and eval splits (see above; a local file's split names only
            label it).
        eval_path, eval_name: another dataset for evaluation (default: ``path``, ``name``).
        revision: a Hub revision (tag, branch or commit) for both.
        question_key, answer_key: the columns holding the problem and the gold answer.
        system_key: a column holding a per-row system prompt (None: ``env.system_prompt``).
        answer_extractor: ``none``, ``gsm8k`` (after ``####``), ``boxed`` (MATH) or a dotted
            path to ``fn(str) -> str``, applied to the answer column.
        scorer: ``math_verify`` (equivalent expressions) or ``integer`` (last integer equal).
        instruction: appended to each question.
        eval_fraction: the share of rows held out for evaluation, when they are (see above).
        streaming, max_rows: read only the first ``max_rows`` rows of each split (streamed).
    """

    def __init__(
        self,
        path: str,
        name: str | None = None,
        split: str = "train",
        eval_split: str | None = AUTO,
        eval_path: str | None = None,
        eval_name: str | None = None,
        revision: str | None = None,
        question_key: str = "question",
        answer_key: str = "answer",
        system_key: str | None = None,
        answer_extractor: str = "none",
        scorer: str = "math_verify",
        instruction: str = "",
        eval_fraction: float = 0.1,
        streaming: bool = False,
        max_rows: int | None = None,
    ) -> None:
        if scorer not in SCORERS:
            raise ConfigError("env.kwargs.scorer", scorer, f"one of {sorted(SCORERS)}")
        get_answer_extractor(answer_extractor)  # a bad name fails before any loading
        self.score = SCORERS[scorer]
        columns = Columns(question_key, answer_key, system_key, answer_extractor, scorer)
        train = Source(path, name, split, revision, streaming, max_rows)
        evals = eval_source(train, eval_path, eval_name, eval_split, eval_fraction)
        self.train, self.eval = prepared_splits(train, evals, float(eval_fraction), columns)
        self.question_key, self.system_key = question_key, system_key
        self.instruction = instruction
        self.gold: str | None = None

    def num_rows(self, evaluation: bool) -> int:
        return len(self.eval.rows if evaluation else self.train.rows)

    def reset(
        self, seed: int | None = None, *, row_index: int | None = None, evaluation: bool = False
    ) -> tuple[str | list[dict[str, str]], dict[str, Any]]:
        part = self.eval if evaluation else self.train
        i = (row_index if row_index is not None else seed or 0) % len(part.rows)
        row, self.gold = part.rows[i], part.golds[i]
        question = str(row[self.question_key])
        text = f"{question}\n{self.instruction}" if self.instruction else question
        # The row's columns, for reward functions: a copy, so nothing can change the cached row.
        info = {**copy.deepcopy(row), "gold": self.gold}
        if self.system_key:
            return [
                {"role": "system", "content": str(row[self.system_key])},
                {"role": "user", "content": text},
            ], info
        return text, info

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.gold is None:
            raise RuntimeError("DatasetEnv.step called before reset")
        correct = self.score(action, self.gold)
        return "", float(correct), True, False, {"correct": correct}
