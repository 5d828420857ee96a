"""Build env factories from config: any class importable by its dotted path (``env._target_``)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from hydra.utils import get_object

from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.envs.base import TextEnv, num_rows

TEXT_ENV_METHODS = "reset(seed=None, *, row_index=None, evaluation=False) and step(action)"


def env_class(target: str) -> type[TextEnv]:
    """The class ``env._target_`` names, checked to be a :class:`TextEnv` class without calling
    anything (a function such as ``os.system`` is refused, not run)."""
    try:
        obj = get_object(target)
    except Exception as err:
        raise ConfigError("env._target_", target, f"an importable TextEnv class ({err})") from err
    if not isinstance(obj, type):
        raise ConfigError(
            "env._target_",
            target,
            f"the dotted path of a TextEnv class (one with {TEXT_ENV_METHODS}), not of a "
            f"{type(obj).__name__}",
        )
    if not issubclass(obj, TextEnv):  # TextEnv is a runtime-checkable Protocol of methods only
        missing = [m for m in ("reset", "step") if not callable(getattr(obj, m, None))]
        raise ConfigError(
            "env._target_",
            target,
            f"a TextEnv class: {obj.__name__} lacks {' and '.join(missing) or 'reset or step'}; "
            f"it needs {TEXT_ENV_METHODS}",
        )
    return obj


def env_factory(target: str, kwargs: dict[str, Any]) -> Callable[[], TextEnv]:
    """A zero-argument callable making fresh envs of the class ``target`` with ``kwargs``."""
    cls = env_class(target)
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as err:
        raise ConfigError(
            "env.kwargs",
            dict(kwargs),
            f"arguments accepted by {target} ({err}); start from env=custom (empty kwargs) for your own env class",
        ) from None
    except ValueError:  # no signature to check (e.g. a class implemented in C)
        pass
    # A class may share what every episode's env needs (a server it starts: env=openenv) through
    # a ``shared_factory(**kwargs)`` classmethod returning the zero-argument callable.
    shared = getattr(cls, "shared_factory", None)
    factory = shared(**kwargs) if callable(shared) else functools.partial(cls, **kwargs)
    factory()  # fail now, not at the first rollout, when the env cannot be built
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
