"""The console progress bar, labelled by what it counts (Lightning's reads ``Epoch 0/-2`` when
a run is bounded by ``max_steps`` alone)."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import RichProgressBar


class StepProgressBar(RichProgressBar):
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
