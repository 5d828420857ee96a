"""Progress on the console: the rich bar in a terminal, labelled by what it counts (Lightning's
reads ``Epoch 0/-2`` when a run is bounded by ``max_steps`` alone), and a compact line every few
steps when the output is not a terminal (:class:`ProgressLog`)."""

from __future__ import annotations

import sys
import time
from typing import Any

from lightning.pytorch.callbacks import Callback, RichProgressBar

from rlhf_lightning.rollout.hooks import RolloutHooks


class StepProgressBar(RolloutHooks, RichProgressBar):
    """Lightning's rich bar labelled ``train`` (optimizer steps bound the run, not epochs), with
    the phase inside a step while it runs (rollout, log-probs, update k/K)."""

    def _get_train_description(self, current_epoch: int) -> str:
        label = "train"
        return f"{label:{len(self.validation_description)}}"  # padded like the eval bar: no flicker

    def on_phase(self, trainer: Any, pl_module: Any, text: str) -> None:
        """Show where a long step is (``rollout: turn 2/5, 37 episodes``, ``update 2/4``) in the label."""
        if self.progress is None or self.train_progress_bar_id is None:
            return
        self.progress.update(self.train_progress_bar_id, description=f"train · {text}")
        self.refresh()

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self.progress is not None and self.train_progress_bar_id is not None:  # the step is done
            self.progress.update(self.train_progress_bar_id, description=self._get_train_description(0))


def format_duration(seconds: float) -> str:
    """``42s``, ``3m 05s``, ``2h 07m``."""
    s = max(round(seconds), 0)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    return f"{s // 3600}h {s % 3600 // 60:02d}m"


def auto_every(max_steps: int) -> int:
    """About 20 lines a run, at least every step, at most every 100 steps."""
    return min(max(max_steps // 20, 1), 100) if max_steps > 0 else 10


class ProgressLog(Callback):
    """A compact line every ``every_n_steps`` steps for output that is not a terminal (a log
    file, CI, SLURM), where the rich bar shows nothing::

        step 120/900 (13%) | reward 0.412 | eval acc 0.350 (step 100) | 45s elapsed | ETA 4m 53s

    ``eval acc``: the latest greedy (else sampled) held-out accuracy. Rank 0 prints.
    """

    def __init__(self, every_n_steps: int, stream: Any = None) -> None:
        if every_n_steps < 1:
            raise ValueError(f"progress.every_n_steps must be >= 1, got {every_n_steps}")
        self.every = every_n_steps
        self.stream = stream if stream is not None else sys.stdout
        self.started: float | None = None
        self.start_step = 0
        self.eval: tuple[str, float, int] | None = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.started, self.start_step = time.perf_counter(), trainer.global_step

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        for key in ("eval/accuracy_greedy", "eval/accuracy_sampled"):
            value = trainer.callback_metrics.get(key)
            if value is not None:
                self.eval = (key.rsplit("_", 1)[-1], float(value), trainer.global_step)
                return

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step, total = trainer.global_step, trainer.max_steps
        if step % self.every and step != total:
            return
        if trainer.is_global_zero:
            print(self.line(step, total, trainer.callback_metrics), file=self.stream, flush=True)

    def line(self, step: int, total: int, metrics: Any) -> str:
        elapsed = time.perf_counter() - (self.started if self.started is not None else time.perf_counter())
        parts = [f"step {step}/{total} ({100 * step // total}%)" if total > 0 else f"step {step}"]
        reward = metrics.get("rollout/reward_mean", metrics.get("train/loss"))
        if reward is not None:
            name = "reward" if "rollout/reward_mean" in metrics else "loss"
            parts.append(f"{name} {float(reward):.3f}")
        if self.eval is not None:
            kind, value, at = self.eval
            parts.append(f"eval acc{'' if kind == 'greedy' else ' (sampled)'} {value:.3f} (step {at})")
        parts.append(f"{format_duration(elapsed)} elapsed")
        done = step - self.start_step
        if total > 0 and done > 0 and step < total:
            parts.append(f"ETA {format_duration(elapsed / done * (total - step))}")
        return " | ".join(parts)
