"""Build env factories from config: any class importable by its dotted path (``env._target_``)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from hydra.utils import get_object

from rlhf_lightning.envs.base import TextEnv, num_rows
from rlhf_lightning.validation import ConfigError


def env_factory(target: str, kwargs: dict[str, Any]) -> Callable[[], TextEnv]:
    """A zero-argument callable making fresh envs; checks the first one against :class:`TextEnv`."""
    try:
        cls = get_object(target)
    except Exception as err:
        raise ConfigError("env._target_", target, f"an importable TextEnv class ({err})") from err
    factory = functools.partial(cls, **kwargs)
    try:
        probe = factory()
    except TypeError as err:
        raise ConfigError(
            "env.kwargs",
            dict(kwargs),
            f"arguments accepted by {target} ({err}); start from env=custom (empty kwargs) for your own env class",
        ) from err
    if not isinstance(probe, TextEnv):
        raise ConfigError(
            "env._target_",
            target,
            "a class with reset(seed=None, *, row_index=None, evaluation=False) and step(action)",
        )
    return factory


def split_sizes(
    factory: Callable[[], TextEnv], train_size: int | None, eval_size: int | None
) -> tuple[int, int]:
    """Rows in the train and eval splits: the env's ``num_rows`` if it has one, else the config's."""
    probe = factory()
    sizes = []
    for evaluation, configured, field in (
        (False, train_size, "env.train_size"),
        (True, eval_size, "env.eval_size"),
    ):
        n = configured if configured is not None else num_rows(probe, evaluation)
        if n is None:
            raise ConfigError(field, None, f"{type(probe).__name__} has no num_rows(evaluation); set {field}")
        if n <= 0:
            raise ConfigError(field, n, "a positive number of rows")
        sizes.append(int(n))
    return sizes[0], sizes[1]
