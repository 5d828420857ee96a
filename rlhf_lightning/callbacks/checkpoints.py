"""Bounded disk: the last ``checkpoint.keep_last`` step checkpoints (and their exported
adapters), ``last.ckpt``, and the best one by ``checkpoint.monitor`` (``best.ckpt``)."""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint

from rlhf_lightning.callbacks.adapters import export_adapters

log = logging.getLogger(__name__)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Checkpoints written to a temporary file in their destination directory, flushed to disk,
    then renamed over the final name: a kill, a full disk or a crash mid-write never leaves a
    truncated ``.ckpt`` under its name, whatever filesystem the run directory is on.

    (Lightning's own save goes through fsspec, which stages the file in ``$TMPDIR`` and moves
    it: across filesystems that move is a copy, which a full disk can leave half-written.)
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options, got {storage_options!r}")
        atomic_torch_save(checkpoint, Path(path))


def atomic_torch_save(obj: Any, path: Path) -> None:
    """``torch.save(obj, path)`` through a temporary file beside ``path`` and ``os.replace``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        Path(tmp).unlink(missing_ok=True)
        full = getattr(err, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "unexpected pos" in str(err)
        if full:  # torch's own message ("unexpected pos ...") names neither the file nor the cause
            free = shutil.disk_usage(path.parent).free
            raise OSError(
                errno.ENOSPC,
                f"checkpoint {path} not written: no space left on its filesystem ({free / 2**20:.0f} MiB "
                f"free now; {type(err).__name__}: {err}); free disk space or lower checkpoint.keep_last",
            ) from err
        raise


class StepCheckpoint(ModelCheckpoint):
    """Lightning's ModelCheckpoint for ``step_<N>.ckpt`` (and ``last.ckpt`` beside each), without
    its save of ``last.ckpt`` at the end of training: the run writes that one itself, from the
    state the next step starts from (``run/fit.py`` at a normal end, the signal and guard stops at
    theirs). Saved after the fit loop has wound up, it would overwrite a stop's checkpoint with a
    state that does not resume exactly."""

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        return


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
    """``best.ckpt``: the checkpoint at the evaluation with the best ``monitor`` value so far,
    and (``export_adapters``, LoRA) its adapters in ``adapters/best`` (what ``export --which best``
    reads).

    The value is the logged one (global over ranks), so every rank decides the same and joins
    the save. A metric the run never logs is reported once and otherwise ignored."""

    def __init__(
        self, ckpt_dir: str | Path, monitor: str, mode: str = "max", export_adapters: bool = True
    ) -> None:
        if mode not in ("max", "min"):
            raise ValueError(f"checkpoint.monitor_mode must be max or min, got {mode!r}")
        self.path = Path(ckpt_dir) / "best.ckpt"
        self.adapters = Path(ckpt_dir) / "adapters" / "best" if export_adapters else None
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
            trainer.save_checkpoint(self.path, weights_only=False)
            if self.adapters is not None:
                export_adapters(trainer, pl_module, [self.adapters])

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.best = state_dict.get("best")
