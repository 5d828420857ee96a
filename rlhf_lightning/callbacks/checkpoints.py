"""Bounded disk: the last ``checkpoint.keep_last`` step checkpoints (and their exported
adapters), ``last.ckpt``, and the best one by ``checkpoint.monitor`` (``best.ckpt``)."""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path
from typing import Any

import lightning as L

log = logging.getLogger(__name__)

STEP_FILE = re.compile(r"step_(\d+)\.ckpt$")
STEP_DIR = re.compile(r"step_(\d+)$")


def _steps(paths: list[Path], pattern: re.Pattern[str]) -> list[tuple[int, Path]]:
    found = [(int(m.group(1)), p) for p in paths if (m := pattern.search(p.name))]
    return sorted(found)


class KeepLast(L.Callback):
    """Before each step checkpoint is written, delete all but the ``keep_last - 1`` newest older
    ones (so ``keep_last`` remain) and the exported adapters of deleted steps. Rank 0 deletes."""

    def __init__(self, ckpt_dir: str | Path, keep_last: int) -> None:
        self.ckpt_dir, self.keep_last = Path(ckpt_dir), keep_last

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: Any) -> None:
        if self.keep_last < 0 or not trainer.is_global_zero:
            return
        files = _steps(list(self.ckpt_dir.glob("step_*.ckpt")), STEP_FILE)
        older = [(s, p) for s, p in files if s < trainer.global_step]
        for _, path in older[: max(len(older) - max(self.keep_last - 1, 0), 0)]:
            path.unlink(missing_ok=True)
        kept = {s for s, p in files if p.exists()} | {trainer.global_step}
        for step, d in _steps(list((self.ckpt_dir / "adapters").glob("step_*")), STEP_DIR):
            if step not in kept:
                shutil.rmtree(d, ignore_errors=True)


class BestCheckpoint(L.Callback):
    """``best.ckpt``: the checkpoint at the evaluation with the best ``monitor`` value so far.

    The value is the logged one (global over ranks), so every rank decides the same and joins
    the save. A metric the run never logs is reported once and otherwise ignored."""

    def __init__(self, ckpt_dir: str | Path, monitor: str, mode: str = "max") -> None:
        if mode not in ("max", "min"):
            raise ValueError(f"checkpoint.monitor_mode must be max or min, got {mode!r}")
        self.path = Path(ckpt_dir) / "best.ckpt"
        self.monitor, self.mode = monitor, mode
        self.best: float | None = None
        self._warned = False

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        value = trainer.callback_metrics.get(self.monitor)
        if value is None:
            if not self._warned and trainer.is_global_zero:
                log.warning("checkpoint.monitor=%s is not logged by this run: no best.ckpt", self.monitor)
            self._warned = True
            return
        v = float(value)
        if self.best is None or (v > self.best if self.mode == "max" else v < self.best):
            self.best = v
            trainer.save_checkpoint(self.path)

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.best = state_dict.get("best")
