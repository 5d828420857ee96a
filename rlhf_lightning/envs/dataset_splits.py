"""The checked train and eval rows of ``env=dataset``: every row's gold answer checked once per
process, and the eval rows chosen so that they are never training rows (another split or
dataset, or a fixed hold-out of the train rows)."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.envs.dataset_answers import get_answer_extractor, is_integer
from rlhf_lightning.envs.dataset_files import Row, Source
from rlhf_lightning.envs.files import warn_shared_rows

AUTO = "auto"  # eval_split's default: "test", or a hold-out for a single local file
HOLDOUT_KEY = b"rlhf_lightning.holdout.v1"  # the held-out rows' fixed seed (same every run and rank)


@dataclass(frozen=True)
class Columns:
    """Which columns hold what, and how the gold answer is read and scored."""

    question: str
    answer: str
    system: str | None
    extractor: str
    scorer: str


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
        warn_shared_rows(rows, eval_rows, evals.label())
        return Split(rows, golds), Split(eval_rows, checked_golds(evals, columns))
    if len(rows) < 2:
        raise ConfigError(
            "env.kwargs.path",
            train.path,
            f"at least 2 rows to hold out eval rows from: {train.label()} has 1",
        )
    held = holdout(len(rows), fraction)
    part = [[i for i in range(len(rows)) if (i in held) == ev] for ev in (False, True)]
    warn_shared_rows([rows[i] for i in part[0]], [rows[i] for i in part[1]], train.label())
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
