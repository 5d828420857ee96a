"""Single-turn problems from a Hugging Face ``datasets`` dataset (a Hub id or local files).

    python train.py env=gsm8k                       # openai/gsm8k, main, train -> test
    python train.py env=dataset env.kwargs.path=/data/train.parquet env.kwargs.question_key=prompt

A row is one task: ``reset`` returns its question (and the row's columns in ``info``, which
``reward=function`` receives), ``step`` scores the reply against the gold answer, extracted
from the answer column by ``answer_extractor`` (GSM8K's ``#### n``, MATH's last ``\\boxed{}``,
or a function of yours).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hydra.utils import get_object

from rlhf_lightning.envs.arithmetic import final_integer
from rlhf_lightning.envs.math import verify
from rlhf_lightning.validation import ConfigError

Row = dict[str, Any]
LOCAL_BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv"}


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


def integer_match(completion: str, gold: str) -> bool:
    """The completion's last integer equals the gold answer (an integer)."""
    value = final_integer(completion)
    return value is not None and re.fullmatch(r"-?\d+", gold.strip()) is not None and value == int(gold)


SCORERS: dict[str, Callable[[str, str], bool]] = {"math_verify": verify, "integer": integer_match}


@functools.lru_cache(maxsize=8)
def load_rows(
    path: str, name: str | None, split: str, revision: str | None, streaming: bool, max_rows: int | None
) -> tuple[Row, ...]:
    """The rows of one split, loaded once per process (every episode builds its own env).

    ``path`` is a local ``.parquet``/``.jsonl``/``.json``/``.csv`` file, a local dataset
    directory, or a Hub id. With ``streaming`` only the first ``max_rows`` rows are read.
    """
    try:
        import datasets
    except ImportError as err:  # a core dependency; only a broken install lacks it
        raise ImportError("env=dataset needs the datasets package: pip install datasets") from err
    local = Path(path).expanduser()
    kwargs: dict[str, Any] = {"split": split, "streaming": streaming}
    if local.is_file():
        if local.suffix not in LOCAL_BUILDERS:
            raise ConfigError("env.kwargs.path", path, f"a file ending in one of {sorted(LOCAL_BUILDERS)}")
        args: tuple[str, ...] = (LOCAL_BUILDERS[local.suffix],)
        kwargs.update(data_files={split: str(local)})
    else:
        args = (str(local) if local.is_dir() else path, *([name] if name else []))
        kwargs["revision"] = revision
    try:
        ds = datasets.load_dataset(*args, **kwargs)
    except Exception as err:
        raise ConfigError(
            "env.kwargs.path",
            path,
            f"a dataset that loads with datasets.load_dataset (split {split!r}"
            f"{f', subset {name!r}' if name else ''}): {type(err).__name__}: {err}. Without the "
            "Hugging Face Hub, download it elsewhere and point env.kwargs.path at the local files",
        ) from None
    if streaming:
        if max_rows is None:
            raise ConfigError("env.kwargs.max_rows", None, "a row count: streaming reads only that many rows")
        return tuple(dict(row) for row in ds.take(max_rows))
    rows = ds if max_rows is None else ds.select(range(min(max_rows, len(ds))))
    return tuple(rows.to_list())


class DatasetEnv:
    """One problem per dataset row; reward 1.0 when the reply's answer matches the gold one.

    Args:
        path: Hub id, local data file or dataset directory (``datasets.load_dataset``).
        name: the subset (``load_dataset``'s ``name``, e.g. GSM8K's ``main``).
        split, eval_split: the train and eval splits; ``eval_split=None`` holds out the last
            ``eval_fraction`` of the train split.
        eval_path, eval_name: another dataset for evaluation (default: ``path``, ``name``).
        revision: a Hub revision (tag, branch or commit) for both.
        question_key, answer_key: the columns holding the problem and the gold answer.
        system_key: a column holding a per-row system prompt (None: ``env.system_prompt``).
        answer_extractor: ``none``, ``gsm8k`` (after ``####``), ``boxed`` (MATH) or a dotted
            path to ``fn(str) -> str``, applied to the answer column.
        scorer: ``math_verify`` (equivalent expressions) or ``integer`` (last integer equal).
        instruction: appended to each question.
        streaming, max_rows: read only the first ``max_rows`` rows of each split (streamed).
    """

    def __init__(
        self,
        path: str,
        name: str | None = None,
        split: str = "train",
        eval_split: str | None = "test",
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
        self.extract = get_answer_extractor(answer_extractor)
        self.score = SCORERS[scorer]
        train = load_rows(path, name, split, revision, streaming, max_rows)
        if eval_split is None:
            cut = max(1, int(len(train) * (1 - eval_fraction)))
            train, evals = train[:cut], train[cut:]
        else:
            evals = load_rows(eval_path or path, eval_name or name, eval_split, revision, streaming, max_rows)
        for rows, which in ((train, split), (evals, eval_split or "held-out")):
            if not rows:
                raise ConfigError("env.kwargs.path", path, f"a dataset whose {which} split has rows")
            missing = [k for k in (question_key, answer_key, system_key) if k and k not in rows[0]]
            if missing:
                raise ConfigError(
                    "env.kwargs", {"question_key": question_key, "answer_key": answer_key},
                    f"columns of the {which} split: {missing} missing, it has {sorted(rows[0])}",
                )  # fmt: skip
        self.train, self.eval = train, evals
        self.question_key, self.answer_key, self.system_key = question_key, answer_key, system_key
        self.instruction = instruction
        self.gold: str | None = None

    def num_rows(self, evaluation: bool) -> int:
        return len(self.eval if evaluation else self.train)

    def reset(
        self, seed: int | None = None, *, row_index: int | None = None, evaluation: bool = False
    ) -> tuple[str | list[dict[str, str]], dict[str, Any]]:
        rows = self.eval if evaluation else self.train
        row = rows[(row_index if row_index is not None else seed or 0) % len(rows)]
        self.gold = self.extract(str(row[self.answer_key]))
        question = str(row[self.question_key])
        text = f"{question}\n{self.instruction}" if self.instruction else question
        info = {**row, "gold": self.gold}  # the row's columns: reward functions receive them
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
