"""Stop on a signal with nothing lost: SIGTERM (cluster shutdown, ``kill``), SIGUSR1 (SLURM's
pre-emption warning, ``#SBATCH --signal=USR1@120``) and SIGINT (Ctrl-C) let the step in progress
finish, save a checkpoint of it, and end the run; the CLI then exits with 128 + the signal's
number. A second Ctrl-C interrupts at once (no checkpoint of the step in progress; exit code 130).
During an evaluation run on its own (before or after training: :func:`validate_or_stop`) the
same signals end the evaluation after the batch in progress and the run with the same code.

A signal may reach one rank only: the ranks agree at each step's end (one all-reduce) and stop
together.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.trainer.states import TrainerFn

from rlhf_lightning.runtime.distributed import is_distributed

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class StoppedBySignal(Exception):
    """Raised between the batches of an evaluation run on its own (``trainer.validate``) after a
    stop signal: the evaluation ends there (:func:`validate_or_stop` catches it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name} during the evaluation")
        self.signum = signum


def validate_or_stop(trainer: L.Trainer, module: L.LightningModule, dm: Any, stop: StopOnSignal) -> int:
    """``trainer.validate`` (outside the fit); 0, or 128 + the number of the stop signal that
    arrived during it (the evaluation then ended after the batch in progress)."""
    with contextlib.suppress(StoppedBySignal):
        trainer.validate(module, datamodule=dm, verbose=False)
    if stop.received and stop.stopped_by is None:
        stop.stopped_by = stop.received
        log.warning("stopped by %s during the evaluation", signal.Signals(stop.received).name)
    return 128 + stop.stopped_by if stop.stopped_by is not None else 0


def stop_after_this_step(trainer: L.Trainer) -> None:
    """End the fit after the current step, even before Lightning's minimum epochs/steps (which
    default to one epoch and would otherwise keep the run going)."""
    trainer.fit_loop.min_epochs = 0
    trainer.fit_loop.epoch_loop.min_steps = 0
    trainer.should_stop = True


class StopOnSignal(L.Callback):
    """Args: ckpt_dir: where the checkpoint of the last finished step goes (``last.ckpt``)."""

    def __init__(self, ckpt_dir: str | Path) -> None:
        self.ckpt_path = Path(ckpt_dir) / "last.ckpt"
        self.received = 0
        self.stopped_by: int | None = None  # the signal that ended the run
        self.interrupted = False  # a second Ctrl-C stopped the run at once
        self._previous: dict[int, Any] = {}
        self._evaluating = False  # in an evaluation on its own, not in the fit

    def _handle(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and self.received == signal.SIGINT:
            self.interrupted = True  # the run exits with 130 (128 + SIGINT), not Lightning's 1
            raise KeyboardInterrupt  # the second Ctrl-C: stop now
        self.received = signum
        log.warning(
            "received %s: the run stops after the %s in progress",
            signal.Signals(signum).name,
            "evaluation batch" if self._evaluating else "step, with a checkpoint of it",
        )

    def pressed_twice(self, err: BaseException) -> bool:
        """Whether ``err`` ended the run because Ctrl-C was pressed a second time: raised by this
        handler during the fit (Lightning turns it into exit code 1; inside a checkpoint save,
        torch's zip writer raises its own error over it; the save is atomic, so nothing is
        half-written), or by Python's own handler once the fit has ended (the final export)."""
        return self.interrupted or (isinstance(err, KeyboardInterrupt) and self.received == signal.SIGINT)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._install()

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn == TrainerFn.VALIDATING:  # an evaluation on its own (not in the fit)
            self._evaluating = True
            self._install()

    def _install(self) -> None:
        # After Lightning's own handlers (registered when the run starts), which it restores later.
        if threading.current_thread() is not threading.main_thread() or self._previous:
            return
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _agreed(self, trainer: L.Trainer, pl_module: L.LightningModule) -> int:
        """The signal received on any rank (one all-reduce with several processes), else 0."""
        received = self.received
        if is_distributed(trainer.world_size):  # every rank stops at the same batch
            flag = torch.tensor([received], device=pl_module.device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            received = int(flag.item())
        return received

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.state.fn != TrainerFn.VALIDATING:
            return  # an evaluation inside the fit: the step's end decides
        received = self._agreed(trainer, pl_module)
        if received:
            self.received = received
            raise StoppedBySignal(received)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        received = self._agreed(trainer, pl_module)
        if not received or self.stopped_by is not None:
            return
        trainer.save_checkpoint(self.ckpt_path, weights_only=False)
        self.stopped_by = received
        stop_after_this_step(trainer)
        if trainer.is_global_zero:
            log.warning(
                "stopped by %s after step %d; checkpoint: %s (resume with ckpt_path=%s)",
                signal.Signals(received).name,
                trainer.global_step,
                self.ckpt_path,
                self.ckpt_path,
            )

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._evaluating = False
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
