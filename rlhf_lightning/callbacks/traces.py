"""Rollout traces every N steps: whole episodes in ``traces.jsonl`` and, per logger, a text
summary (TensorBoard) and a ``traces`` table (W&B). Rank 0 only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger

from rlhf_lightning.config.errors import check
from rlhf_lightning.traces.text import render_text
from rlhf_lightning.traces.writer import FILE, TraceWriter, episode_record

COLUMNS = ["step", "episode", "group", "return", "turns", "rewards", "prompt", "transcript"]


def table_rows(records: list[dict[str, Any]]) -> list[list[Any]]:
    """One W&B table row per episode (``COLUMNS``); the transcript without contexts."""
    return [
        [
            r["step"],
            r["episode"],
            r["group"],
            r["return"],
            r["num_turns"],
            str([t["reward"] for t in r["turns"]]),
            r["prompt"],
            render_text(r, context=False),
        ]
        for r in records
    ]


class RolloutTraces(L.Callback):
    """Every ``every_n_steps`` training steps, the step's first ``episodes`` episodes (the first
    member's with a population) from ``pl_module.last_trajectories``: each turn's context, reply,
    observation, reward, finish reason and policy version, strings clipped to ``max_chars``,
    ``traces.jsonl`` kept within ``max_bytes`` (see :mod:`rlhf_lightning.traces.writer`)."""

    def __init__(
        self, every_n_steps: int, output_dir: str | Path, episodes: int, max_bytes: int, max_chars: int
    ) -> None:
        check(every_n_steps >= 0, "trace.every_n_steps", every_n_steps, ">= 0 (0 turns traces off)")
        check(episodes >= 1, "trace.episodes", episodes, ">= 1 (episodes traced per traced step)")
        check(max_bytes >= 1024, "trace.max_bytes", max_bytes, ">= 1024 (the bound on traces.jsonl)")
        check(max_chars >= 0, "trace.max_chars", max_chars, ">= 0 (0: text fields unclipped)")
        self.every_n_steps, self.episodes, self.max_chars = every_n_steps, episodes, max_chars
        self.writer = TraceWriter(Path(output_dir) / FILE, max_bytes)
        self._count = 0

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._count += 1
        trajectories = getattr(pl_module, "last_trajectories", None)  # a rollout module's
        harness: Any = getattr(pl_module, "harness", None)
        if (
            not trajectories
            or harness is None
            or self._count % self.every_n_steps != 0
            or not trainer.is_global_zero
        ):
            return
        step = trainer.global_step

        def decode(ids: list[int]) -> str:  # special tokens kept: the chat template as the model saw it
            return harness.tokenizer.decode(ids, skip_special_tokens=False) if ids else ""

        timings = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("perf/")}
        version = int(getattr(pl_module, "last_rollout_version", step))
        records = [
            episode_record(
                t,
                step=step,
                index=i,
                version=version,
                decode=decode,
                max_chars=self.max_chars,
                timings=timings,
            )
            for i, t in enumerate(trajectories[: self.episodes])
        ]
        written = self.writer.write_step(step, records)
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                text = "\n".join(render_text(r, context=False) for r in records[:written])
                logger.experiment.add_text("traces", f"```\n{text}\n```", step)
            elif isinstance(logger, WandbLogger):
                logger.log_table("traces", columns=COLUMNS, data=table_rows(records), step=step)
