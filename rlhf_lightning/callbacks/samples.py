"""A table of a few prompts, completions and rewards every N steps, in each logger's format."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger


def render_markdown(step: int, samples: list[dict[str, Any]]) -> str:
    lines = [f"## step {step}", "", "| reward | prompt | completion |", "|---:|---|---|"]
    for s in samples:
        cells = [str(s[k]).replace("|", "\\|").replace("\n", "⏎") for k in ("prompt", "completion")]
        lines.append(f"| {s['reward']:.3g} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines) + "\n\n"


class SampleTable(L.Callback):
    """Every ``every_n_steps`` training steps: ``samples.md`` in the run directory (CSV logger),
    a text summary (TensorBoard) and a ``samples`` table (W&B)."""

    def __init__(self, every_n_steps: int, output_dir: str | Path) -> None:
        self.every_n_steps = every_n_steps
        self.path = Path(output_dir) / "samples.md"
        self._count = 0

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._count += 1
        samples = getattr(pl_module, "last_samples", None)
        if not samples or self._count % self.every_n_steps != 0 or not trainer.is_global_zero:
            return
        step = trainer.global_step
        text = render_markdown(step, samples)
        for logger in trainer.loggers:
            if isinstance(logger, CSVLogger):
                self.path.parent.mkdir(parents=True, exist_ok=True)
                with self.path.open("a") as f:
                    f.write(text)
            elif isinstance(logger, TensorBoardLogger):
                logger.experiment.add_text("samples", text, step)
            elif isinstance(logger, WandbLogger):
                # Through the logger: the row carries trainer/global_step, and W&B's own step is
                # left alone (an explicit older step would drop the table from the history).
                rows = [[s["prompt"], s["completion"], s["reward"]] for s in samples]
                logger.log_table("samples", columns=["prompt", "completion", "reward"], data=rows, step=step)
