"""Checks of a sweep's own settings before its first trial (a Hydra callback: the sweeper runs
before any job, so a bad ``hydra.sweeper.*`` value would otherwise surface as the sweeper's
error at the end, e.g. Optuna's "No trials are completed yet")."""

from __future__ import annotations

from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


def sweep_problem(sweeper: DictConfig) -> str | None:
    """What is wrong with an Optuna sweeper node, as ``error: invalid config: ...``; or None."""
    for field in ("n_trials", "n_jobs"):
        value = sweeper.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            return (
                f"error: invalid config: hydra.sweeper.{field}={value!r}: a positive number of "
                f"{'trials' if field == 'n_trials' else 'parallel trials'} (e.g. hydra.sweeper.{field}=20)"
            )
    return None


class CheckSweep(Callback):
    """``hparams_search=optuna``: refuse ``hydra.sweeper.n_trials`` / ``n_jobs`` < 1 at once."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        problem = sweep_problem(config.hydra.sweeper)
        if problem is not None:
            raise SystemExit(problem)
