"""The value a run hands to a Hydra sweeper (Optuna): ``optimized_metric``, checked as soon as the
run has logged what it will log, and read back from ``metrics.csv`` at the end."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L

from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.plot import read_metrics


def _unknown(name: str, logged: list[str]) -> ConfigError:
    return ConfigError(
        "optimized_metric",
        name,
        f"a metric this run logs ({', '.join(logged)}); set optimized_metric=<one of them>, or null",
    )


class CheckOptimizedMetric(L.Callback):
    """Fail early when the run will never log ``name``: an ``eval/`` metric at the first
    evaluation's end (before training when ``eval.before_training``), any other at the end of the
    first training step. The message lists the names the run does log."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.checked = False

    def _check(self, trainer: L.Trainer, prefix_eval: bool) -> None:
        if self.checked or self.name.startswith("eval/") != prefix_eval:
            return
        self.checked = True
        logged = sorted(k for k in trainer.callback_metrics if k.startswith("eval/") == prefix_eval)
        if self.name not in trainer.callback_metrics:
            raise _unknown(self.name, logged)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._check(trainer, prefix_eval=True)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._check(trainer, prefix_eval=False)


def optimized_value(output_dir: Path, name: str, mode: str = "final", direction: str = "maximize") -> float:
    """``name``'s last logged value in ``output_dir/metrics.csv`` (``final``), or its best over
    the run (``best``: the largest when ``direction`` is maximize, else the smallest)."""
    metrics = read_metrics(output_dir)
    series = metrics.get(name) or []
    if not series:
        raise _unknown(name, sorted(k for k, v in metrics.items() if v))
    values = [v for _, v in series]
    if mode == "final":
        return values[-1]
    return max(values) if direction == "maximize" else min(values)
