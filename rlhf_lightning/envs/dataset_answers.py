"""Gold answers of dataset rows (``env=dataset``): the extractors that read them from an answer
column (GSM8K's ``#### n``, MATH's last ``\\boxed{}``, or a function of yours) and the scorers
that match a reply against them."""

from __future__ import annotations

import re
from collections.abc import Callable

from hydra.utils import get_object

from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.envs.arithmetic import final_integer
from rlhf_lightning.envs.math import verify


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
