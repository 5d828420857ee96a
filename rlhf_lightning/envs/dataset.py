"""Single-turn problems from a Hugging Face ``datasets`` dataset (a Hub id or local files).

    python train.py env=gsm8k                       # openai/gsm8k, main, train -> test
    python train.py env=dataset env.kwargs.path=/data/train.parquet env.kwargs.question_key=prompt

A row is one task: ``reset`` returns its question (and a copy of the row's columns in ``info``,
which ``reward=function`` receives), ``step`` scores the reply against the gold answer, extracted
from the answer column by ``answer_extractor`` (GSM8K's ``#### n``, MATH's last ``\\boxed{}``,
or a function of yours). Every row is checked at start-up; eval rows are never training rows.

The parts: :mod:`~rlhf_lightning.envs.dataset_answers` (extractors and scorers),
:mod:`~rlhf_lightning.envs.dataset_files` (loading a split) and
:mod:`~rlhf_lightning.envs.dataset_splits` (checked rows, the eval rows); their names are
re-exported here.
"""

from __future__ import annotations

import copy
from typing import Any

from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.envs.dataset_answers import (
    ANSWER_EXTRACTORS,
    SCORERS,
    after_hashes,
    get_answer_extractor,
    integer_match,
    is_integer,
    last_boxed,
)
from rlhf_lightning.envs.dataset_files import (
    LOCAL_BUILDERS,
    TEXT_FORMATS,
    Row,
    Source,
    first_invalid_utf8,
    is_blank,
    load_error,
    load_rows,
)
from rlhf_lightning.envs.dataset_splits import (
    AUTO,
    HOLDOUT_KEY,
    Columns,
    Split,
    checked_golds,
    eval_source,
    gold_answer,
    holdout,
    prepared_splits,
    row_problem,
)

__all__ = [
    "ANSWER_EXTRACTORS",
    "AUTO",
    "HOLDOUT_KEY",
    "LOCAL_BUILDERS",
    "SCORERS",
    "TEXT_FORMATS",
    "Columns",
    "DatasetEnv",
    "Row",
    "Source",
    "Split",
    "after_hashes",
    "checked_golds",
    "eval_source",
    "first_invalid_utf8",
    "get_answer_extractor",
    "gold_answer",
    "holdout",
    "integer_match",
    "is_blank",
    "is_integer",
    "last_boxed",
    "load_error",
    "load_rows",
    "prepared_splits",
    "row_problem",
]


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
