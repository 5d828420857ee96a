"""Algorithm families as registered records: what ``run/fit.py`` and validation need to know.

A family is its LightningModule, its config schema and a few facts (online rollouts or an
offline dataset, whether it needs a reference or a critic). ``algo.module`` names a registered
family, or an importable Python module that registers one when imported (a family defined
outside this package: its module and its YAML are all it takes).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig


def _never(hp: Any) -> bool:
    return False


def _no_checks(algo: DictConfig, cfg: DictConfig) -> None:
    return None


@dataclass(frozen=True)
class AlgorithmSpec:
    """One algorithm family.

    Args:
        name: the ``algo.module`` value (and ``/schema/algo/<name>`` in Hydra's ConfigStore).
        module_cls: the LightningModule class. Online families subclass ``RolloutModule``
            (constructed as ``cls(policy, harness, engine, sampling, hp, ...)``); offline ones
            ``OfflineModule`` (``cls(policy, hp, harness, engine, sampling, ...)``).
        schema: the config dataclass; YAML files start from it.
        data: ``online`` (prompts -> rollouts in an env) or ``offline`` (a dataset file).
        offline_kind: the offline dataset layout: ``sft`` or ``preference``.
        needs_reference: whether the policy must carry a reference, given the config.
        needs_critic: whether the policy carries a critic adapter and value head.
        validate: the family's own start-up checks ``(algo, whole config)``; raise ConfigError.
    """

    name: str
    module_cls: type
    schema: type
    data: str = "online"
    offline_kind: str | None = None
    needs_reference: Callable[[Any], bool] = _never
    needs_critic: bool = False
    validate: Callable[[DictConfig, DictConfig], None] = _no_checks

    def __post_init__(self) -> None:
        if self.data not in ("online", "offline"):
            raise ValueError(f"AlgorithmSpec.data must be online or offline, got {self.data!r}")


ALGORITHMS: dict[str, AlgorithmSpec] = {}


def register_algorithm(spec: AlgorithmSpec) -> AlgorithmSpec:
    """Add a family (raises on a duplicate name) and store its schema for the YAML files."""
    if spec.name in ALGORITHMS:
        raise ValueError(
            f"algorithm family {spec.name!r} is already registered ({ALGORITHMS[spec.name].module_cls})"
        )
    ALGORITHMS[spec.name] = spec
    ConfigStore.instance().store(group="schema/algo", name=spec.name, node=spec.schema)
    return spec


def get_algorithm(module: str) -> AlgorithmSpec:
    """The family named ``module``, importing ``module`` first when it is a Python module path."""
    if module not in ALGORITHMS and "." in module:
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise KeyError(f"algo.module={module!r}: cannot import it ({err})") from err
        last = module.rsplit(".", 1)[-1]
        found = [s for s in ALGORITHMS.values() if s.module_cls.__module__ == module]
        if len(found) == 1:
            ALGORITHMS.setdefault(module, found[0])
        elif last in ALGORITHMS:
            ALGORITHMS.setdefault(module, ALGORITHMS[last])
    if module not in ALGORITHMS:
        raise KeyError(
            f"algo.module={module!r}: not a registered family; valid: {', '.join(sorted(ALGORITHMS))}, "
            "or an importable module that calls register_algorithm"
        )
    return ALGORITHMS[module]
