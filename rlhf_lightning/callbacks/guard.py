"""A run that diverges or collapses says so (``guard.*``).

Divergence: an optimizer step whose gradient norm is not finite is skipped by the module (the
weights keep their last good values) and counted in ``guard/skipped_steps``; after
``guard.max_nonfinite_steps`` in a row the run stops with a checkpoint of the last good step.

Collapse: a signal that holds for ``guard.patience`` steps in a row logs a warning naming it, and
stops the run (with a checkpoint) when ``guard.stop_on_collapse=true``:
    empty completions   ``rollout/empty_frac`` >= ``guard.empty_frac``
    zero gradient       ``actor/grad_norm`` == 0 (nothing to learn from, or nothing learnt)
    reward at its floor ``rollout/reward_std`` == 0 with the reward at the lowest mean seen so far
The module's ``last_step`` summary holds the logged values, already global over ranks, so every
rank decides the same.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L

from rlhf_lightning.callbacks.signals import stop_after_this_step
from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.learner.records import StepSummary

log = logging.getLogger(__name__)


def collapse_signals(empty_frac: float, floor: float) -> dict[str, Callable[[StepSummary], bool]]:
    """Name -> whether the step shows it (``floor``: the lowest reward mean so far)."""

    def empty(s: StepSummary) -> bool:
        return s.empty_frac is not None and s.empty_frac >= empty_frac

    def zero_grad(s: StepSummary) -> bool:
        return s.grad_norm is not None and s.grad_norm == 0.0

    def at_floor(s: StepSummary) -> bool:
        return s.reward_std == 0.0 and s.reward_mean is not None and s.reward_mean <= floor

    return {
        "empty completions (rollout/empty_frac)": empty,
        "zero gradient (actor/grad_norm)": zero_grad,
        "reward stuck at its floor (rollout/reward_std = 0)": at_floor,
    }


class Guard(L.Callback):
    """Args: as ``GuardConfig``; ``ckpt_dir``: where the stop checkpoint goes (``last.ckpt``)."""

    def __init__(
        self,
        ckpt_dir: str | Path,
        *,
        patience: int = 10,
        empty_frac: float = 0.9,
        stop_on_collapse: bool = False,
        max_nonfinite_steps: int = 3,
    ) -> None:
        if patience < 1:  # 0: every step, healthy or not, would already count as a collapse
            raise ConfigError("guard.patience", patience, ">= 1 steps in a row a collapse signal must hold")
        self.ckpt_path = Path(ckpt_dir) / "last.ckpt"
        self.patience, self.empty_frac = patience, empty_frac
        self.stop_on_collapse, self.max_nonfinite_steps = stop_on_collapse, max_nonfinite_steps
        self.streaks: dict[str, int] = {}
        self.floor = math.inf
        self.warned: set[str] = set()
        self.stop_reason: str | None = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self.stop_reason is not None:
            return
        step: StepSummary = getattr(pl_module, "last_step", None) or StepSummary()
        nonfinite = int(getattr(pl_module, "nonfinite_streak", 0))
        if self.max_nonfinite_steps and nonfinite >= self.max_nonfinite_steps:
            self.stop(
                trainer, f"{nonfinite} optimizer steps in a row had a non-finite gradient norm (skipped)"
            )
            return
        mean = step.reward_mean
        for name, fired in collapse_signals(self.empty_frac, self.floor).items():
            self.streaks[name] = self.streaks.get(name, 0) + 1 if fired(step) else 0
            if self.streaks[name] < self.patience:
                continue
            if self.stop_on_collapse:
                self.stop(trainer, f"collapse: {name} for {self.streaks[name]} steps")
                return
            if name not in self.warned and trainer.is_global_zero:
                log.warning(
                    "possible collapse at step %d: %s for %d steps in a row (guard.stop_on_collapse=true "
                    "stops the run)",
                    trainer.global_step,
                    name,
                    self.streaks[name],
                )
            self.warned.add(name)
        if mean is not None:
            self.floor = min(self.floor, mean)

    def stop(self, trainer: L.Trainer, reason: str) -> None:
        trainer.save_checkpoint(self.ckpt_path, weights_only=False)
        stop_after_this_step(trainer)
        self.stop_reason = reason
        if trainer.is_global_zero:
            log.error(
                "run stopped by the guard at step %d: %s; checkpoint: %s",
                trainer.global_step,
                reason,
                self.ckpt_path,
            )
