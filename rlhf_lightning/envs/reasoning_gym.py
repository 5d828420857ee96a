"""reasoning-gym tasks (github.com/open-thought/reasoning-gym, ``pip install 'rlhf_lightning[reasoning_gym]'``).

    python train.py env=reasoning_gym                                        # basic_arithmetic
    python train.py env=reasoning_gym env.kwargs.task=chain_sum '+env.kwargs.task_kwargs={max_terms: 3}'
    python train.py env=reasoning_gym env.kwargs.task=null 'env.kwargs.tasks={chain_sum: 2, gcd: 1}'

A thin adapter: reasoning-gym generates each problem (``create_dataset(name, size, seed, **cfg)``)
and scores the reply with the task's own ``score_answer``. The prompt is reasoning-gym's: its
system prompt (``reasoning_gym.utils.SYSTEM_PROMPTS``, "default" asks for the final answer in
``<answer>...</answer>``) and the question; the answer is read from the reply with its
``extract_answer`` (the last ``<answer>`` block). Train and eval rows are different items of one
dataset of ``train_size + eval_size`` items: train row ``i`` is item ``i``, eval row ``j`` item
``train_size + j``.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import importlib
import json
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from rlhf_lightning.config.errors import ConfigError

RG_EXTRA = "pip install 'rlhf_lightning[reasoning_gym]'"
MAX_SKIPS = 64  # items in a row that fail to generate before reset gives up


def import_rg(task: Any = None) -> ModuleType:
    try:
        return importlib.import_module("reasoning_gym")
    except ImportError as err:
        raise ConfigError(
            "env.kwargs.task",
            task,
            f"an installed reasoning-gym: env=reasoning_gym needs the reasoning_gym extra ({err}): {RG_EXTRA}",
        ) from None


def task_names(task: Any = None) -> list[str]:
    """reasoning-gym's registered task names (``reasoning_gym.factory.DATASETS``)."""
    import_rg(task)
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def system_prompts() -> dict[str, str]:
    """reasoning-gym's standard system prompts by name (``reasoning_gym.utils.SYSTEM_PROMPTS``)."""
    import_rg()
    from reasoning_gym.utils import SYSTEM_PROMPTS

    return dict(SYSTEM_PROMPTS)


@dataclass(frozen=True)
class TaskSpec:
    """One task of the mix: its name, weight and config (as JSON, so the spec is hashable)."""

    name: str
    weight: float
    kwargs_json: str

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(json.loads(self.kwargs_json))


def to_json(value: Any, field: str) -> str:
    try:
        return json.dumps(value, sort_keys=True)
    except TypeError as err:
        raise ConfigError(field, value, f"plain values (numbers, strings, lists, mappings): {err}") from None


def check_task(name: Any, field: str, names: list[str]) -> None:
    """``name`` is a registered task (not ``composite``: a mix goes in ``env.kwargs.tasks``)."""
    if isinstance(name, str) and name in names and name != "composite":
        return
    close = difflib.get_close_matches(str(name), [n for n in names if n != "composite"], n=5, cutoff=0.5)
    hint = f"close: {', '.join(close)}" if close else f"e.g. {', '.join(names[:5])}"
    mix = "; mix tasks with env.kwargs.tasks" if name == "composite" else ""
    raise ConfigError(
        field,
        name,
        f"a reasoning-gym task ({len(names)} in reasoning_gym.factory.DATASETS), {hint}{mix}",
    )


def parse_tasks(task: Any, task_kwargs: Any, tasks: Any) -> tuple[TaskSpec, ...]:
    """The tasks to draw from: ``task`` (+ ``task_kwargs``) alone, or the weighted mix ``tasks``
    (``{name: weight}`` or a list of ``{name, weight, kwargs}``). Checked against the registry."""
    names = task_names(task if task is not None else tasks)
    if (task is None) == (tasks is None):
        raise ConfigError(
            "env.kwargs.tasks",
            tasks,
            f"either env.kwargs.task (now {task!r}) or env.kwargs.tasks, not both and not neither: "
            "set env.kwargs.task=null to use a mix",
        )
    if task is not None:
        if not isinstance(task_kwargs, (dict, type(None))):
            raise ConfigError("env.kwargs.task_kwargs", task_kwargs, "a mapping of the task's config fields")
        check_task(task, "env.kwargs.task", names)
        return (TaskSpec(task, 1.0, to_json(task_kwargs or {}, "env.kwargs.task_kwargs")),)
    if task_kwargs:
        raise ConfigError(
            "env.kwargs.task_kwargs",
            task_kwargs,
            "empty with env.kwargs.tasks: give each task its kwargs in the list form "
            "[{name: ..., weight: ..., kwargs: {...}}]",
        )
    items = [{"name": k, "weight": v} for k, v in tasks.items()] if isinstance(tasks, dict) else tasks
    if not isinstance(items, list) or not items:
        raise ConfigError("env.kwargs.tasks", tasks, "{name: weight, ...} or [{name, weight, kwargs}, ...]")
    specs = []
    for i, item in enumerate(items):
        field = f"env.kwargs.tasks[{i}]"
        if not isinstance(item, dict) or set(item) - {"name", "weight", "kwargs"} or "name" not in item:
            raise ConfigError(field, item, "a mapping with name, weight (default 1) and kwargs (optional)")
        check_task(item["name"], f"{field}.name", names)
        weight = item.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
            raise ConfigError(f"{field}.weight", weight, "a positive number")
        kwargs = item.get("kwargs") or {}
        if not isinstance(kwargs, dict):
            raise ConfigError(f"{field}.kwargs", kwargs, "a mapping of the task's config fields")
        specs.append(TaskSpec(item["name"], float(weight), to_json(kwargs, f"{field}.kwargs")))
    if len({s.name for s in specs}) != len(specs):
        raise ConfigError("env.kwargs.tasks", tasks, "each task once (reasoning-gym's mix refuses repeats)")
    return tuple(specs)


def kwargs_error(spec: TaskSpec, field: str, size: int, err: Exception) -> ConfigError:
    """reasoning-gym's refusal of a task config, with the config's fields."""
    from reasoning_gym.factory import DATASETS

    config_cls = DATASETS[spec.name][1]
    fields = [f.name for f in dataclasses.fields(config_cls) if f.name not in ("seed", "size")]
    return ConfigError(
        field,
        spec.kwargs,
        f"a config {spec.name} accepts (fields of {config_cls.__name__}: {fields}); reasoning-gym "
        f"raised {type(err).__name__}: {err} (size = train_size + eval_size = {size})",
    )


@functools.lru_cache(maxsize=8)
def dataset(specs: tuple[TaskSpec, ...], mix: bool, size: int, seed: int) -> Any:
    """The reasoning-gym dataset of ``size`` items, once per process (every episode builds its
    own env): the one task's, or (``mix``) reasoning-gym's ``composite`` dataset, whose item ``i``
    is item ``i`` of a task picked by weight (task ``k`` seeded ``seed + k + 1``, its own config)."""
    rg = import_rg(specs[0].name)
    for k, spec in enumerate(specs):
        if {"seed", "size"} & set(spec.kwargs):
            field = f"env.kwargs.tasks[{k}].kwargs" if mix else "env.kwargs.task_kwargs"
            raise ConfigError(
                field,
                spec.kwargs,
                "no seed or size: they come from env.kwargs.seed, train_size and eval_size",
            )
    if not mix:
        try:
            return rg.create_dataset(specs[0].name, size=size, seed=seed, **specs[0].kwargs)
        except Exception as err:
            raise kwargs_error(specs[0], "env.kwargs.task_kwargs", size, err) from None
    from reasoning_gym.composite import DatasetSpec

    for k, spec in enumerate(specs):  # a config error names its task, not the mix
        try:
            rg.create_dataset(spec.name, size=size, seed=seed + k + 1, **spec.kwargs)
        except Exception as err:
            raise kwargs_error(spec, f"env.kwargs.tasks[{k}].kwargs", size, err) from None
    parts = [DatasetSpec(s.name, s.weight, s.kwargs) for s in specs]
    return rg.create_dataset("composite", size=size, seed=seed, datasets=parts)


@functools.lru_cache(maxsize=4096)
def item(specs: tuple[TaskSpec, ...], mix: bool, size: int, seed: int, index: int) -> dict[str, Any]:
    """Item ``index`` of the dataset, generated once per process (a group of episodes shares it)."""
    return dict(dataset(specs, mix, size, seed)[index])


def split_item(
    specs: tuple[TaskSpec, ...], mix: bool, size: int, seed: int, start: int, length: int, row: int
) -> tuple[int, dict[str, Any]]:
    """(index, item) of split row ``row``: item ``start + row % length``, or, where generating it
    raises (a reasoning-gym bug, e.g. basic_arithmetic dividing by zero for 3 of its first 100,000
    items), the next item of the same split that generates."""
    first = row % length
    errors: list[str] = []
    for k in range(min(MAX_SKIPS, length)):
        index = start + (first + k) % length
        try:
            return index, item(specs, mix, size, seed, index)
        except Exception as err:
            errors.append(f"{index}: {type(err).__name__}: {err}")
    raise RuntimeError(
        f"reasoning-gym failed to generate items {errors[0]} (and the {len(errors) - 1} after it)"
    )


class ReasoningGymEnv:
    """One reasoning-gym problem per row, scored by the task's own ``score_answer``.

    The prompt: reasoning-gym's system prompt ``system_prompt`` (a name in
    ``reasoning_gym.utils.SYSTEM_PROMPTS``: default, DeepSeekZero, simple, direct,
    chain_of_draft; null: none, then ``env.system_prompt`` applies) and the question as the user
    turn. The reward: ``score_answer(extract_answer(reply), item)`` in [0, 1], where
    ``extract_answer`` is reasoning-gym's (the last ``<answer>...</answer>``, stripped; None
    without one, which scores 0). ``info``: ``score`` (that reward), ``correct`` (score >=
    ``correct_threshold``, read by evaluation's accuracy), ``answered`` (an answer block was
    found). Reset info: the item (``question``, ``answer``, ``metadata``) and its ``index``.

    Splits: one dataset of ``train_size + eval_size`` items (seed ``seed``): train row ``i`` is
    item ``i``, eval row ``j`` item ``train_size + j``, so no eval item is a train item. Items
    are generated from per-item seeds (reasoning-gym's ``Random(seed + index)``), which is why
    two datasets with seeds ``s`` and ``s + 1`` would be the same items shifted by one. The same
    question text can still come out of two items where a task has few distinct questions
    (default configs, 100,000 train rows: 4% of basic_arithmetic's 200 eval questions also appear
    among its train questions, 9% of chain_sum's); make the task harder with its config to
    shrink that.

    Args:
        task: a reasoning-gym task name (``reasoning_gym.factory.DATASETS``), or None with ``tasks``.
        task_kwargs: the task's config fields (``create_dataset(task, **task_kwargs)``).
        tasks: a weighted mix instead of ``task``, ``{name: weight}`` or a list of
            ``{name, weight, kwargs}``, drawn through reasoning-gym's ``composite`` dataset.
        train_size, eval_size: rows per split.
        seed: the dataset's seed.
        system_prompt: the name of reasoning-gym's system prompt, or None.
        correct_threshold: the score from which a reply counts as correct (1.0: full marks).
    """

    def __init__(
        self,
        task: str | None = "basic_arithmetic",
        task_kwargs: dict[str, Any] | None = None,
        tasks: dict[str, float] | list[dict[str, Any]] | None = None,
        train_size: int = 100_000,
        eval_size: int = 200,
        seed: int = 0,
        system_prompt: str | None = "default",
        correct_threshold: float = 1.0,
    ) -> None:
        for field, value in (("train_size", train_size), ("eval_size", eval_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"env.kwargs.{field}", value, "a positive number of rows")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ConfigError("env.kwargs.seed", seed, "an integer >= 0")
        if (
            isinstance(correct_threshold, bool)
            or not isinstance(correct_threshold, (int, float))
            or not (0.0 < correct_threshold <= 1.0)
        ):
            raise ConfigError("env.kwargs.correct_threshold", correct_threshold, "a score in (0, 1]")
        self.specs, self.mix = parse_tasks(task, task_kwargs, tasks), tasks is not None
        prompts = system_prompts()
        if system_prompt is not None and system_prompt not in prompts:
            raise ConfigError(
                "env.kwargs.system_prompt",
                system_prompt,
                f"one of reasoning-gym's SYSTEM_PROMPTS {sorted(prompts)}, or null (then env.system_prompt applies)",
            )
        self.train_size, self.eval_size, self.seed = train_size, eval_size, seed
        self.size = train_size + eval_size
        self.dataset = dataset(self.specs, self.mix, self.size, seed)
        for row, evaluation in ((0, False), (eval_size - 1, True)):  # a bad config fails now
            self.locate(row, evaluation)
        self.system = prompts[system_prompt] if system_prompt is not None else None
        self.correct_threshold = correct_threshold
        self.entry: dict[str, Any] | None = None

    def num_rows(self, evaluation: bool) -> int:
        return self.eval_size if evaluation else self.train_size

    def locate(self, row: int, evaluation: bool) -> tuple[int, dict[str, Any]]:
        """(dataset index, item) of a split's row (see the class docstring)."""
        start, length = (self.train_size, self.eval_size) if evaluation else (0, self.train_size)
        return split_item(self.specs, self.mix, self.size, self.seed, start, length, row)

    def reset(
        self, seed: int | None = None, *, row_index: int | None = None, evaluation: bool = False
    ) -> tuple[str | list[dict[str, str]], dict[str, Any]]:
        index, entry = self.locate(row_index if row_index is not None else seed or 0, evaluation)
        self.entry = copy.deepcopy(entry)  # scorers and reward functions never touch the cached item
        info = {**copy.deepcopy(entry), "index": index}
        question = str(entry["question"])
        if self.system is None:
            return question, info
        return [{"role": "system", "content": self.system}, {"role": "user", "content": question}], info

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.entry is None:
            raise RuntimeError("ReasoningGymEnv.step called before reset")
        from reasoning_gym.utils import extract_answer

        answer = extract_answer(action)
        score = float(self.dataset.score_answer(answer, self.entry))
        info = {"score": score, "correct": score >= self.correct_threshold, "answered": answer is not None}
        return "", score, True, False, info
