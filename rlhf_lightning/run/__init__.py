"""Compose -> build -> fit, and everything a run is made of: the components from the config
(``factories``), the start-up checks (``validation``), the run directory (``rundir``), loggers,
the end-of-run summary, sweeps. The top layer: it may import every other.

``from rlhf_lightning.run import run`` (the Python API, :mod:`rlhf_lightning.run.fit`) and
``build`` keep their old place.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "RunResult",
    "build",
    "checkpoint_step",
    "output_dir_for",
    "population_callback",
    "prepare_run_dir",
    "run",
    "run_callbacks",
    "training_reward",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("rlhf_lightning.run.fit"), name)
    raise AttributeError(f"module 'rlhf_lightning.run' has no attribute {name!r}")
