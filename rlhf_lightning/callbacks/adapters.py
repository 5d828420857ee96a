"""Export the trained adapter as a PEFT directory next to every Lightning checkpoint."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import lightning as L

log = logging.getLogger(__name__)


class AdapterExport(L.Callback):
    """At each checkpoint save, write ``<dirpath>/adapters/step_<N>/actor`` (loadable with
    ``PeftModel.from_pretrained(base, path)``) and refresh ``<dirpath>/adapters/last``."""

    def __init__(self, dirpath: str | Path) -> None:
        self.dirpath = Path(dirpath)
        self._last_step = -1

    def on_save_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        step = trainer.global_step
        policy = getattr(pl_module, "policy", None)
        if step == self._last_step or policy is None or not policy.is_peft:
            return
        self._last_step = step
        state = policy.adapter_state()  # FSDP: the full adapters, gathered by every rank
        if not trainer.is_global_zero:
            return
        for target in (self.dirpath / "adapters" / f"step_{step:06d}", self.dirpath / "adapters" / "last"):
            out = policy.save_adapter(target, state)
        log.info("adapter exported to %s", out)
