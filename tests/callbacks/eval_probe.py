"""A callback for runs in a subprocess
(``+callbacks.probe._target_=tests.callbacks.eval_probe.SlowEval +callbacks.probe.marker=PATH``):
it makes each batch of an evaluation run on its own (before or after training) take
``delay_s`` longer, and writes ``marker`` (``before`` or ``after`` training) once one has run,
so a test knows when a signal lands inside that evaluation."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.trainer.states import TrainerFn


class SlowEval(L.Callback):
    def __init__(self, marker: str, delay_s: float = 0.3) -> None:
        self.marker, self.delay_s = Path(marker), delay_s

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.state.fn != TrainerFn.VALIDATING:
            return
        when = "after" if trainer.global_step else "before"
        if not self.marker.exists():
            self.marker.write_text(when)
        time.sleep(self.delay_s)
