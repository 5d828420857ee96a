"""Extra Lightning callbacks named in the config: ``callbacks.<name>: {_target_: Class, ...}``.

The run's own callbacks (checkpoints, signals, the guard, the engine's lifecycle, progress) carry
its state and are always on; these come after them, in the config's order, so a user adds one
with ``+callbacks.my_cb._target_=my_pkg.MyCallback`` or a file of ``conf/callbacks/`` and drops
one with ``~callbacks.my_cb``. Every entry is checked at start-up (before a model loads).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning as L
from hydra.errors import InstantiationException
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf

from rlhf_lightning.config.errors import ConfigError

WHAT = "a Lightning Callback class, importable by its dotted path (e.g. lightning.pytorch.callbacks.LearningRateMonitor)"


def _entries(node: Any) -> dict[str, Any]:
    if node is None:
        return {}
    if isinstance(node, DictConfig):
        node = OmegaConf.to_container(node, resolve=True)
    if not isinstance(node, Mapping):
        raise ConfigError("callbacks", node, "a mapping {name: {_target_: Class, ...keyword arguments}}")
    return dict(node)


def check_configured_callbacks(node: Any) -> None:
    """Every ``callbacks.<name>`` is a mapping whose ``_target_`` names a Callback subclass."""
    for name, entry in _entries(node).items():
        field = f"callbacks.{name}"
        if not isinstance(entry, Mapping) or not isinstance(entry.get("_target_"), str):
            raise ConfigError(field, entry, f"a mapping with _target_: {WHAT}")
        target = entry["_target_"]
        try:
            cls = get_class(target)
        except Exception as err:  # ImportError, AttributeError, or not a class
            raise ConfigError(f"{field}._target_", target, f"{WHAT} ({err})") from None
        if not issubclass(cls, L.Callback):
            raise ConfigError(f"{field}._target_", target, f"{WHAT}; {cls.__name__} is not a Callback")


def configured_callbacks(node: Any) -> list[L.Callback]:
    """The callbacks of ``node``, instantiated in its order; bad arguments name the entry."""
    check_configured_callbacks(node)
    out: list[L.Callback] = []
    for name, entry in _entries(node).items():
        try:
            out.append(instantiate(entry))
        except InstantiationException as err:
            raise ConfigError(f"callbacks.{name}", entry, f"arguments its class accepts ({err})") from None
    return out
