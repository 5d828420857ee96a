"""What a finished run shows: a table of its evaluations before and after training, its wall
time and the paths of what it wrote, and ``plots.png`` in its directory."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from rlhf_lightning.plot import PLOT_FILE, Metrics, plot_runs, read_metrics

log = logging.getLogger(__name__)


def eval_rows(metrics: Metrics) -> list[tuple[str, float, float]]:
    """``(name, first value, last value)`` of every ``eval/`` metric logged at least once, in
    name order: the first is the evaluation before training (step 0) when there was one."""
    return [(k, v[0][1], v[-1][1]) for k, v in sorted(metrics.items()) if k.startswith("eval/") and v]


def summary_lines(output_dir: Path, wall_s: float, steps: int) -> list[str]:
    """The end-of-run table, one string per line (plain text, fixed-width columns)."""
    logged = (output_dir / "metrics.csv").is_file()  # not when a run stopped before logging anything
    rows = eval_rows(read_metrics(output_dir)) if logged else []
    width = max([len("metric"), *(len(r[0]) for r in rows)])
    lines = [f"{'metric':<{width}}  {'before':>8}  {'after':>8}  {'change':>8}"]
    lines += [f"{k:<{width}}  {a:>8.4f}  {b:>8.4f}  {b - a:>+8.4f}" for k, a, b in rows]
    lines.append(f"{steps} optimizer steps in {wall_s:.0f} s")
    paths = {
        "metrics": output_dir / "metrics.csv",
        "samples": output_dir / "samples.md",
        "adapters": output_dir / "checkpoints" / "adapters" / "last",
        "checkpoint": output_dir / "checkpoints" / "last.ckpt",
        "plot": output_dir / PLOT_FILE,
        "log": output_dir / "train.log",
    }
    lines += [f"{name:<10} {path}" for name, path in paths.items() if path.exists()]
    return lines


def write_plot(output_dir: Path, loggers: list[Any], step: int) -> Path | None:
    """``plots.png`` of this run, also sent to TensorBoard and W&B as an image. None (and a
    warning) when matplotlib is missing or nothing was logged that can be plotted."""
    try:
        path = plot_runs([output_dir], output_dir / PLOT_FILE)
    except (ImportError, ValueError, FileNotFoundError) as err:  # no metrics.csv: nothing logged
        log.warning("no %s: %s", PLOT_FILE, err)
        return None
    for logger in loggers:
        kind = type(logger).__name__
        if kind == "TensorBoardLogger":
            import numpy as np
            from PIL import Image

            image = np.asarray(Image.open(path).convert("RGB"))
            logger.experiment.add_image("plots", image, step, dataformats="HWC")
        elif kind == "WandbLogger":
            import wandb

            logger.experiment.log({"plots": wandb.Image(str(path)), "trainer/global_step": step})
    return path
