"""Export the trained adapters as PEFT directories next to the Lightning checkpoints."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L

log = logging.getLogger(__name__)


def export_adapters(trainer: L.Trainer, pl_module: L.LightningModule, targets: Sequence[Path]) -> Path | None:
    """Write the module's adapters (actor, reference, critic) to every directory of ``targets``.

    Every rank calls this (FSDP gathers the full adapters); rank 0 writes. Returns the actor's
    directory of the last target on rank 0, else None (full fine-tuning: nothing to write)."""
    policy = getattr(pl_module, "policy", None)
    if policy is None or not policy.is_peft:
        return None
    state = policy.adapter_state()  # FSDP: the full adapters, gathered by every rank
    if not trainer.is_global_zero:
        return None
    out = None
    for target in targets:
        out = policy.save_adapter(target, state)
    return out


class AdapterExport(L.Callback):
    """At each checkpoint save, write ``<dirpath>/adapters/step_<N>/actor`` (loadable with
    ``PeftModel.from_pretrained(base, path)``) and refresh ``<dirpath>/adapters/last``.

    :meth:`export_final` rewrites ``adapters/last`` from the module as the fit left it (a
    population's best member, loaded at the fit's end, at the same step as the last checkpoint)."""

    def __init__(self, dirpath: str | Path) -> None:
        self.dirpath = Path(dirpath)
        self._last_step = -1

    def on_save_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        step = trainer.global_step
        if step == self._last_step:
            return
        self._last_step = step
        adapters = self.dirpath / "adapters"
        out = export_adapters(trainer, pl_module, [adapters / f"step_{step:06d}", adapters / "last"])
        if out is not None:
            log.debug("adapter exported to %s", out)

    def export_final(self, trainer: L.Trainer, pl_module: L.LightningModule) -> Path | None:
        """``adapters/last`` from the module now (every rank calls this)."""
        return export_adapters(trainer, pl_module, [self.dirpath / "adapters" / "last"])
