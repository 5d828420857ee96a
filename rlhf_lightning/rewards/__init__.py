"""Rewards beyond the env's own (``reward=function|model``): scored once per rollout, in batches.

A training episode's reward is ``weights[env] * (the env's per-turn rewards)`` plus, on its final
turn, the weighted sum of the other components' scores (one per episode). Evaluation keeps the
env's rewards: its accuracy stays the env's ground truth whatever the training reward is.

A component scores a whole batch: ``score(episodes, device) -> list[float]``, raw. Its
``normalize`` says whether the training step standardises those scores over the global batch
(``batch``, once per step over every rank and every rollout round: see
:meth:`CombinedReward.finalize`) or uses them as they are (``none``).
"""

from __future__ import annotations

import copy
import importlib.util
import inspect
import io
import logging
import math
import numbers
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from hydra.utils import get_object

from rlhf_lightning.config.errors import ConfigError, UserCodeError
from rlhf_lightning.runtime.workers import CallTimeout, shared_pool

SOURCES = ("env", "function", "model")
NORMALIZE = ("none", "batch")
# The keyword arguments a reward function gets besides the env's columns; a column of the same
# name is not passed (the function's own argument wins).
RESERVED = ("prompts", "completions", "replies")
SIGNATURE = "fn(prompts, completions, **kwargs) -> list[float]"
FN_TIMEOUT_S = 300.0  # reward.fn_timeout_s's default: one call (a whole batch) past it is stopped
REWARD_POOL = "reward-fn"  # the shared worker pool reward functions with a time limit run in
# Batch standardisation: (x - mean) / (std + STD_EPS), std unbiased (n - 1), as torch.std.
STD_EPS = 1e-6

log = logging.getLogger(__name__)


@dataclass
class Episode:
    """What a reward component sees of one finished episode."""

    prompt: str | list[dict[str, str]]  # the env's first observation (text or chat messages)
    replies: list[str]  # the policy's reply in each turn, decoded
    columns: dict[str, Any] = field(default_factory=dict)  # the env's reset info (dataset columns)
    env_return: float = 0.0


class RewardComponent(Protocol):
    name: str
    normalize: str  # none | batch (standardised over the global batch by CombinedReward.finalize)

    def score(self, episodes: Sequence[Episode], device: Any) -> list[float]: ...


def accepted_keywords(fn: Callable[..., Any], path: str) -> frozenset[str] | None:
    """The keyword arguments ``fn`` takes, None when it takes any (``**kwargs``) or its signature
    cannot be read (a builtin: its call is checked instead).

    Raises ConfigError, at start-up rather than at the first rollout, when ``fn`` cannot be called
    as ``fn(prompts=..., completions=..., ...)``: it lacks ``prompts`` or ``completions`` (and
    ``**kwargs``), or needs a positional-only argument.
    """
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    kinds = inspect.Parameter
    named = frozenset(p.name for p in params if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY))
    any_keyword = any(p.kind == kinds.VAR_KEYWORD for p in params)
    positional = [p.name for p in params if p.kind == kinds.POSITIONAL_ONLY and p.default is p.empty]
    missing = [] if any_keyword else [k for k in ("prompts", "completions") if k not in named]
    if positional or missing:
        problem = f"needs positional-only {positional}" if positional else f"takes no {missing}"
        raise ConfigError(
            "reward.fn",
            path,
            f"a function {SIGNATURE} (called with keywords prompts, completions, replies and the "
            f"env's columns); {path} has the signature {inspect.signature(fn)}, which {problem}",
        )
    return None if any_keyword else named


class FunctionReward:
    """A user function, TRL-style: ``fn(prompts, completions, **kwargs) -> list[float]``.

    ``completions`` are the final replies; ``replies`` (each episode's list of replies) and the
    env's reset-info columns present in every episode (a dataset env's row) come as keywords.
    A function without ``**kwargs`` gets only the keywords it names. Every call gets deep copies
    of the prompts and columns: a function that mutates them cannot change the dataset's rows,
    other episodes or later steps.

    With ``timeout_s`` (``reward.fn_timeout_s``) each call runs in a worker process, like env
    steps with ``env.step_timeout_s`` (:class:`~rlhf_lightning.runtime.workers.WorkerPool`): one
    that has not returned after ``timeout_s`` seconds is stopped (its worker killed with what it
    started) and fails the run with an error naming the limit. The function must then be
    picklable (a module-level function or class) and sees none of the trainer's in-process
    state. ``None``: called in this process, without a limit. A function the worker cannot import
    (defined in ``__main__``: a script or a notebook; or in a module that is no file on
    ``sys.path``) is also called in this process, with one warning that it has no limit
    (:func:`not_importable_in_a_worker`).
    """

    normalize = "none"

    def __init__(self, path: str, timeout_s: float | None = None) -> None:
        try:
            fn = get_object(path)
        except Exception as err:
            raise ConfigError(
                "reward.fn", path, f"the dotted path of an importable function ({err})"
            ) from None
        if not callable(fn):
            raise ConfigError("reward.fn", path, f"a callable, not a {type(fn).__name__}")
        self.keywords = accepted_keywords(fn, path)
        self.fn: Callable[..., Any] = fn
        self.name = getattr(fn, "__name__", path.rsplit(".", 1)[-1])
        self.path = path
        if timeout_s is not None and not (isinstance(timeout_s, int | float) and timeout_s > 0):
            raise ConfigError(
                "reward.fn_timeout_s", timeout_s, "a time limit > 0 seconds, or null (no limit)"
            )
        if timeout_s is not None:
            module = not_importable_in_a_worker(fn, path, timeout_s)
            if module is not None:
                log.warning(
                    "reward.fn=%s is defined in (or refers to) %s, which a worker process cannot import: it runs in "
                    "the trainer's process WITHOUT a time limit (reward.fn_timeout_s=%g does not "
                    "apply; a call that hangs hangs the run). For a limit, define it in an importable "
                    "module (a .py file on sys.path) and give its dotted path; "
                    "reward.fn_timeout_s=null silences this warning",
                    path,
                    module,
                    timeout_s,
                )
                timeout_s = None
        self.timeout_s = timeout_s

    def arguments(self, episodes: Sequence[Episode], fresh: bool = True) -> dict[str, list[Any]]:
        """The keyword arguments of one call: fresh copies (see the class docstring), unless
        ``fresh`` is False (a call in a worker process: pickling them copies them already)."""
        shared = set.intersection(*(set(e.columns) for e in episodes)) if episodes else set()
        shared -= set(RESERVED)
        copied = copy.deepcopy if fresh else lambda value: value
        kwargs: dict[str, list[Any]] = {
            "prompts": copied([e.prompt for e in episodes]),
            "completions": [e.replies[-1] if e.replies else "" for e in episodes],
            "replies": [list(e.replies) for e in episodes],
            **{k: copied([e.columns[k] for e in episodes]) for k in sorted(shared)},
        }
        if self.keywords is None:
            return kwargs
        absent = sorted(self.required() - set(kwargs))
        if absent:
            raise ValueError(
                f"reward.fn={self.path} takes {absent}, which are neither {list(RESERVED)} nor "
                f"columns of every episode (the columns are {sorted(shared)}); give those "
                "arguments defaults or take **kwargs"
            )
        return {k: v for k, v in kwargs.items() if k in self.keywords}

    def required(self) -> set[str]:
        """The named arguments without a default."""
        params = inspect.signature(self.fn).parameters.values()
        return {p.name for p in params if p.default is p.empty and p.kind != p.VAR_POSITIONAL}

    def score(self, episodes: Sequence[Episode], device: Any) -> list[float]:
        kwargs = self.arguments(episodes, fresh=self.timeout_s is None)
        what = f"reward.fn={self.path} (the reward function {self.name})"
        if self.timeout_s is None:
            try:
                out = self.fn(**kwargs)
            except Exception as err:
                raise UserCodeError(
                    f"{what} raised {type(err).__name__}: {err} while scoring {len(episodes)} completions"
                ) from err
            return checked_scores(out, len(episodes), f"reward.fn={self.path}")
        try:
            outcome = shared_pool(REWARD_POOL, 1).call(self.fn, (), kwargs, timeout_s=self.timeout_s)
        except TypeError as err:  # an argument (an env column) that cannot be pickled
            raise UserCodeError(
                f"{what} cannot run in a worker process (reward.fn_timeout_s={self.timeout_s:g}): "
                f"{err}. Set reward.fn_timeout_s=null to call it in the trainer's process"
            ) from err
        problem = outcome.error
        if isinstance(problem, CallTimeout):
            raise UserCodeError(
                f"{what} did not return within {self.timeout_s:g} s (reward.fn_timeout_s) while "
                f"scoring {len(episodes)} completions; it was stopped. Make it faster, raise "
                "reward.fn_timeout_s, or set it to null (no limit)"
            )
        if problem is not None:
            raise UserCodeError(
                f"{what} raised {type(problem).__name__}: {problem} while scoring {len(episodes)} completions "
                "(in a worker process: reward.fn_timeout_s)"
            ) from problem
        return checked_scores(outcome.output, len(episodes), f"reward.fn={self.path}")


def not_importable_in_a_worker(fn: Callable[..., Any], path: str, timeout_s: float) -> str | None:
    """The module (``__main__``, or one that is no file on ``sys.path``) of ``fn``, or of a
    function or class that pickling ``fn`` refers to by name, that a worker process cannot import
    (it would fail on every call); None when the worker can unpickle ``fn``.

    Raises ConfigError when ``fn`` (from an importable module) cannot be pickled at all.
    """
    own = getattr(fn, "__module__", None)  # a partial has none: what it wraps is recorded below
    if isinstance(own, str) and not importable(own):
        return own  # a notebook's lambda too: it runs in-process, pickled or not
    modules: set[str] = set()

    class Recorder(pickle.Pickler):
        def reducer_override(self, obj: Any) -> Any:
            if isinstance(obj, type) or inspect.isfunction(obj):  # pickled by module and name
                modules.add(str(getattr(obj, "__module__", None)))
            return NotImplemented

    try:
        Recorder(io.BytesIO(), protocol=pickle.HIGHEST_PROTOCOL).dump(fn)
    except Exception as err:
        raise ConfigError(
            "reward.fn",
            path,
            f"a picklable function (module level) to run in a worker process under "
            f"reward.fn_timeout_s={timeout_s:g}; pickling failed: {err}. Or set "
            "reward.fn_timeout_s=null to call it in the trainer's process, without a limit",
        ) from None
    return next((m for m in sorted(modules) if not importable(m)), None)


def importable(module: str) -> bool:
    """Whether a fresh process with this one's ``sys.path`` can import ``module``."""
    if module == "__main__":  # the worker's __main__ is its own module, not the trainer's script
        return False
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: in sys.modules without a spec (made in memory)
        return False


def reward_value(reward: Any) -> float | None:
    """``reward`` as a float when it is a finite real number (a Python, NumPy or 0-d tensor
    number; not a bool), else None."""
    if getattr(reward, "ndim", None) == 0 and callable(getattr(reward, "item", None)):
        reward = reward.item()  # NumPy scalar, 0-d array or 0-d tensor -> Python number
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real):
        return None
    try:
        value = float(reward)
    except OverflowError:  # an int beyond float range
        return None
    return value if math.isfinite(value) else None


def checked_scores(out: Any, n: int, source: str) -> list[float]:
    """``out`` as ``n`` floats when it is a list, tuple, 1-d NumPy array or 1-d tensor of finite
    real numbers (not bools, not strings), else an error naming ``source``."""
    expected = (
        f"{source} must return a list (or tuple, 1-d NumPy array, 1-d tensor) of {n} finite real "
        "numbers, one per completion (not bools or strings)"
    )
    is_array = getattr(out, "ndim", None) == 1 and callable(getattr(out, "tolist", None))
    if not (isinstance(out, list | tuple) or is_array):
        raise TypeError(f"{expected}; it returned a {type(out).__name__}: {out!r:.200}")
    items = list(out)
    if len(items) != n:
        raise ValueError(f"{source} returned {len(items)} scores for {n} episodes")
    values = [reward_value(v) for v in items]
    bad = [i for i, v in enumerate(values) if v is None]
    if bad:
        i = bad[0]
        raise TypeError(
            f"{expected}; {len(bad)} of its {n} scores are not, the first is score {i}: "
            f"{items[i]!r:.80} ({type(items[i]).__name__})"
        )
    return [v for v in values if v is not None]


def standardized(
    raw: torch.Tensor, all_sum: Callable[[torch.Tensor], torch.Tensor], device: Any = "cpu"
) -> torch.Tensor:
    """Each row of ``raw`` standardised with its mean and std over every rank's values, in one
    collective: ``(x - mean) / (std + STD_EPS)``, std unbiased (``n - 1``, like ``torch.std``;
    0 for a single value, so a lone score becomes 0).

    ``all_sum`` sums a tensor over ranks (the identity with one process); it gets one float64
    tensor of shape (k, 3), per row ``[count, sum, sum of squares]``, on ``device``.
    Shape: raw (k, n) -> (k, n), float64. Notation: k components, n this rank's episodes.
    """
    raw = raw.to(torch.float64)
    count = torch.full((raw.shape[0],), float(raw.shape[1]), dtype=torch.float64)
    local = torch.stack([count, raw.sum(1), raw.square().sum(1)], 1)
    stats = all_sum(local.to(device)).to("cpu", torch.float64)  # (k, 3)
    count, total, squares = stats.unbind(1)
    mean = total / count.clamp(min=1)
    var = (squares - count * mean.square()).clamp(min=0) / (count - 1).clamp(min=1)
    return (raw - mean[:, None]) / (var.sqrt()[:, None] + STD_EPS)


class CombinedReward:
    """The training reward from the env and the configured components, with their weights.

    Two calls per training step: :meth:`apply` after each rollout (several with dynamic
    sampling: it writes rewards from the raw scores, which is what groups are filtered on), then
    :meth:`finalize` once on the step's final batch (it standardises ``normalize=batch``
    components over the whole global batch and rewrites the rewards).
    """

    def __init__(self, components: list[RewardComponent], weights: dict[str, float], use_env: bool) -> None:
        names = (["env"] if use_env else []) + [c.name for c in components]
        if len(set(names)) != len(names):
            raise ConfigError("reward", names, "components with distinct names (two functions share one)")
        unknown = sorted(set(weights) - set(names))
        if unknown:
            raise ConfigError(
                "reward.weights", dict(weights), f"keys among the components {names}: {unknown}"
            )
        for c in components:
            if getattr(c, "normalize", "none") not in NORMALIZE:
                raise ConfigError("reward.normalize", c.normalize, f"one of {', '.join(NORMALIZE)}")
        self.components = components
        self.use_env = use_env
        self.env_weight = weights.get("env", 1.0) if use_env else 0.0
        self.weights = {c.name: weights.get(c.name, 1.0) for c in components}

    def apply(self, trajectories: Sequence[Any], device: Any = "cpu") -> dict[str, float]:
        """Score ``trajectories`` and write their rewards from the raw scores, in place.

        Keeps each one's env rewards in ``t.env_rewards`` (the first time) and each component's
        raw score in ``t.reward_parts[name]``, for :meth:`finalize`. Returns this call's
        ``reward/<name>`` means.
        """
        for t in trajectories:
            if not t.env_rewards:
                t.env_rewards = list(t.rewards)
        episodes = [
            Episode(t.observation, list(t.replies), dict(t.task_info), float(sum(t.env_rewards)))
            for t in trajectories
        ]
        for comp in self.components:
            for t, s in zip(trajectories, comp.score(episodes, device)):
                t.reward_parts[comp.name] = s
        for t in trajectories:
            t.rewards = self.combined(t.env_rewards, t.reward_parts)
        return self.metrics(trajectories)

    def finalize(
        self,
        trajectories: Sequence[Any],
        all_sum: Callable[[torch.Tensor], torch.Tensor],
        device: Any = "cpu",
    ) -> dict[str, float]:
        """The step's rewards, written in place: ``normalize=batch`` scores standardised over the
        final global batch (every round of this step, every rank: :func:`standardized`).

        Called once per training step, after the last rollout, on every rank (one collective
        when a component normalises, none otherwise). ``all_sum`` sums a tensor over ranks;
        ``device`` is where its input goes (the trainer's device under NCCL). Also writes each
        trajectory's ``reward_terms`` (:meth:`terms`). Returns
        ``reward/env``, ``reward/<name>`` (raw score means) and ``reward/total`` (the training
        return) over this rank's trajectories.
        """
        missing = [c.name for c in self.components if any(c.name not in t.reward_parts for t in trajectories)]
        if missing:
            raise RuntimeError(f"CombinedReward.finalize: no {missing} scores; apply must run first")
        parts = [dict(t.reward_parts) for t in trajectories]
        batch = [c.name for c in self.components if getattr(c, "normalize", "none") == "batch"]
        if batch:
            raw = torch.tensor([[p[name] for p in parts] for name in batch], dtype=torch.float64)
            raw = raw.reshape(len(batch), len(parts))  # (k, n), also for n = 0
            for name, row in zip(batch, standardized(raw, all_sum, device).tolist()):
                for p, value in zip(parts, row):
                    p[name] = value
        for t, p in zip(trajectories, parts):
            t.rewards = self.combined(t.env_rewards, p)
            t.reward_terms = self.terms(t.env_rewards, p)
        return self.metrics(trajectories)

    def terms(self, env_rewards: Sequence[float], parts: dict[str, float]) -> dict[str, tuple[float, float]]:
        """Each term of the training return as (weight, return): ``env`` (the env's summed rewards,
        when it is a source) and every component's score; the return is their weighted sum
        (decoupled advantages normalise each term on its own: ``algo.advantage=gdpo``)."""
        out = {"env": (self.env_weight, math.fsum(env_rewards))} if self.use_env else {}
        return {**out, **{name: (w, parts[name]) for name, w in self.weights.items()}}

    def combined(self, env_rewards: Sequence[float], parts: dict[str, float]) -> list[float]:
        """Per-turn rewards: the weighted env rewards, plus the weighted scores on the last turn."""
        rewards = [self.env_weight * r for r in env_rewards] or [0.0]
        rewards[-1] += sum(w * parts[name] for name, w in self.weights.items())
        return rewards

    def metrics(self, trajectories: Sequence[Any]) -> dict[str, float]:
        """Means over ``trajectories``: env return, each component's raw score, training return."""
        n = max(len(trajectories), 1)
        out = {"reward/env": sum(math.fsum(t.env_rewards) for t in trajectories) / n}
        for name in self.weights:
            out[f"reward/{name}"] = sum(t.reward_parts[name] for t in trajectories) / n
        out["reward/total"] = sum(math.fsum(t.rewards) for t in trajectories) / n
        return out


def build_reward(
    sources: Sequence[str],
    fns: Any = None,
    weights: Any = None,
    model_kwargs: dict[str, Any] | None = None,
    fn_timeout_s: float | None = FN_TIMEOUT_S,
) -> CombinedReward | None:
    """The training reward for ``reward.sources``; None for the env alone at weight 1 (no work).
    ``fn_timeout_s``: each reward function's time limit (:class:`FunctionReward`)."""
    sources = list(sources)
    bad = [s for s in sources if s not in SOURCES]
    if bad or not sources or len(set(sources)) != len(sources):
        raise ConfigError("reward.sources", sources, f"distinct names among {', '.join(SOURCES)}")
    if weights is not None and (
        not isinstance(weights, dict)
        or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in weights.values())
    ):
        raise ConfigError(
            "reward.weights", weights, "a mapping {component: number}, e.g. {env:1.0,model:0.5}"
        )
    weights = dict(weights or {})
    if sources == ["env"] and set(weights) <= {"env"} and weights.get("env", 1.0) == 1.0:
        return None
    components: list[RewardComponent] = []
    if "function" in sources:
        paths = [fns] if isinstance(fns, str) else list(fns or [])
        if not paths:
            raise ConfigError("reward.fn", fns, "the dotted path of a reward function (or a list of them)")
        components += [FunctionReward(p, fn_timeout_s) for p in paths]
    elif fns:
        raise ConfigError("reward.fn", fns, "used only when reward.sources includes function")
    if "model" in sources:
        from rlhf_lightning.rewards.model import ModelReward

        components.append(ModelReward(**(model_kwargs or {})))
    return CombinedReward(components, weights, use_env="env" in sources)
