"""Rewards beyond the env's own (``reward=function|model``): scored once per rollout, in batches.

A training episode's reward is ``weights[env] * (the env's per-turn rewards)`` plus, on its final
turn, the weighted sum of the other components' scores (one per episode). Evaluation keeps the
env's rewards: its accuracy stays the env's ground truth whatever the training reward is.

A component scores a whole batch: ``score(episodes, device) -> list[float]``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from hydra.utils import get_object

from rlhf_lightning.validation import ConfigError

SOURCES = ("env", "function", "model")


@dataclass
class Episode:
    """What a reward component sees of one finished episode."""

    prompt: str | list[dict[str, str]]  # the env's first observation (text or chat messages)
    replies: list[str]  # the policy's reply in each turn, decoded
    columns: dict[str, Any] = field(default_factory=dict)  # the env's reset info (dataset columns)
    env_return: float = 0.0


class RewardComponent(Protocol):
    name: str

    def score(self, episodes: Sequence[Episode], device: Any) -> list[float]: ...


class FunctionReward:
    """A user function, TRL-style: ``fn(prompts, completions, **columns) -> list[float]``.

    ``completions`` are the final replies; ``replies`` (each episode's list of replies) and the
    env's reset-info columns present in every episode (a dataset env's row) come as keywords.
    """

    def __init__(self, path: str) -> None:
        try:
            fn = get_object(path)
        except Exception as err:
            raise ConfigError(
                "reward.fn", path, f"the dotted path of an importable function ({err})"
            ) from None
        if not callable(fn):
            raise ConfigError("reward.fn", path, f"a callable, not a {type(fn).__name__}")
        self.fn: Callable[..., Sequence[float]] = fn
        self.name = getattr(fn, "__name__", path.rsplit(".", 1)[-1])
        self.path = path

    def score(self, episodes: Sequence[Episode], device: Any) -> list[float]:
        shared = set.intersection(*(set(e.columns) for e in episodes)) if episodes else set()
        shared -= {"prompts", "completions", "replies"}  # the function's own arguments win
        out = self.fn(
            prompts=[e.prompt for e in episodes],
            completions=[e.replies[-1] if e.replies else "" for e in episodes],
            replies=[list(e.replies) for e in episodes],
            **{k: [e.columns[k] for e in episodes] for k in sorted(shared)},
        )
        return checked_scores(out, len(episodes), f"reward.fn={self.path}")


def checked_scores(out: Any, n: int, source: str) -> list[float]:
    """``out`` as ``n`` finite floats, else an error naming ``source``."""
    try:
        values = [float(v) for v in out]
    except (TypeError, ValueError) as err:
        raise TypeError(f"{source} must return a list of {n} numbers, got {out!r:.200} ({err})") from None
    if len(values) != n:
        raise ValueError(f"{source} returned {len(values)} scores for {n} episodes")
    bad = [v for v in values if not math.isfinite(v)]
    if bad:
        raise ValueError(f"{source} returned non-finite scores {bad[:3]}")
    return values


class CombinedReward:
    """The training reward from the env and the configured components, with their weights."""

    def __init__(self, components: list[RewardComponent], weights: dict[str, float], use_env: bool) -> None:
        names = (["env"] if use_env else []) + [c.name for c in components]
        if len(set(names)) != len(names):
            raise ConfigError("reward", names, "components with distinct names (two functions share one)")
        unknown = sorted(set(weights) - set(names))
        if unknown:
            raise ConfigError(
                "reward.weights", dict(weights), f"keys among the components {names}: {unknown}"
            )
        self.components = components
        self.env_weight = weights.get("env", 1.0) if use_env else 0.0
        self.weights = {c.name: weights.get(c.name, 1.0) for c in components}

    def apply(self, trajectories: Sequence[Any], device: Any = "cpu") -> dict[str, float]:
        """Rewrite each trajectory's per-turn rewards in place; returns ``reward/<name>`` means."""
        n = len(trajectories)
        episodes = [
            Episode(t.observation, list(t.replies), dict(t.task_info), float(sum(t.rewards)))
            for t in trajectories
        ]
        metrics = {"reward/env": sum(e.env_return for e in episodes) / max(n, 1)}
        extra = [0.0] * n
        for comp in self.components:
            scores = comp.score(episodes, device)
            metrics[f"reward/{comp.name}"] = sum(scores) / max(n, 1)
            w = self.weights[comp.name]
            extra = [x + w * s for x, s in zip(extra, scores)]
        for t, x in zip(trajectories, extra):
            t.rewards = [self.env_weight * r for r in t.rewards] or [0.0]
            t.rewards[-1] += x
        metrics["reward/total"] = sum(sum(t.rewards) for t in trajectories) / max(n, 1)
        return metrics


def build_reward(
    sources: Sequence[str],
    fns: Any = None,
    weights: Any = None,
    model_kwargs: dict[str, Any] | None = None,
) -> CombinedReward | None:
    """The training reward for ``reward.sources``; None for the env alone at weight 1 (no work)."""
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
        components += [FunctionReward(p) for p in paths]
    elif fns:
        raise ConfigError("reward.fn", fns, "used only when reward.sources includes function")
    if "model" in sources:
        from rlhf_lightning.rewards.model import ModelReward

        components.append(ModelReward(**(model_kwargs or {})))
    return CombinedReward(components, weights, use_env="env" in sources)
