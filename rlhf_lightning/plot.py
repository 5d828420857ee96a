"""Plot training runs from their run directories (``metrics.csv``, ``config.yaml``).

read_metrics  per column of ``metrics.csv``, the (step, value) pairs where it was logged
panels        which metrics to draw, in a fixed order: reward, eval accuracy, KL, entropy (else
              clip fraction), and the losses of offline runs; at most four
plot_runs     one PNG, a grid of those panels, one colour per run

CLI: ``python -m rlhf_lightning.plot RUN_DIR [RUN_DIR ...] [--out PATH] [--title T] [--smooth N]``.
matplotlib is imported only when plotting, and pyplot never (no backend is set or changed).
"""

from __future__ import annotations

import argparse
import csv
import math
from pathlib import Path
from typing import Any

import yaml

Metrics = dict[str, list[tuple[int, float]]]

METRICS_FILE = "metrics.csv"
PLOT_FILE = "plots.png"  # a run's own figure, in its directory
CONFIG_FILE = "config.yaml"
NOT_METRICS = ("step", "epoch")
REWARD = "rollout/reward_mean"
ACCURACY = ("eval/accuracy_sampled", "eval/accuracy_greedy")  # one panel: sampled solid, greedy dashed
ENTROPY_OR_CLIPFRAC = ("actor/entropy", "actor/clipfrac")
OFFLINE_LOSSES = ("eval/loss", "train/loss")  # drawn only for runs without rollouts (SFT, DPO)
MAX_PANELS = 4


def read_metrics(run_dir: Path) -> Metrics:
    """Per column of ``run_dir/metrics.csv`` (``step``/``epoch`` aside), the ``(step, value)``
    pairs of the rows where it was logged; Lightning leaves a cell empty when it was not.

    Raises FileNotFoundError when the file is missing, ValueError when it has no ``step``
    column or a cell is not a number.
    """
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: a run dir must contain {METRICS_FILE}")
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        header = reader.fieldnames or []
        if "step" not in header:
            raise ValueError(f"{path} has no 'step' column")
        columns = [c for c in header if c not in NOT_METRICS]
        metrics: Metrics = {c: [] for c in columns}
        for line, row in enumerate(reader, start=2):
            step = int(float(row["step"]))
            for c in columns:
                cell = row.get(c) or ""
                if cell == "":
                    continue
                try:
                    metrics[c].append((step, float(cell)))
                except ValueError:
                    raise ValueError(f"{path} line {line}: {c}={cell!r} is not a number") from None
    return metrics


def _kl_candidates(columns: set[str]) -> list[str]:
    """KL-to-reference columns in preference order: ``actor/kl``, ``kl/*``, other ``actor/kl*``
    (``actor/kl_clamp_frac`` is a fraction, not a KL)."""
    kl = sorted(c for c in columns if c.startswith("kl/"))
    other = sorted(
        c for c in columns if c.startswith("actor/kl") and c != "actor/kl" and not c.endswith("_frac")
    )
    return (["actor/kl"] if "actor/kl" in columns else []) + kl + other


def panels(metrics: list[Metrics]) -> list[str]:
    """The metric keys to draw, one per panel, in the preferred order, at most ``MAX_PANELS``.

    A key is chosen when at least one run logged it. The accuracy panel is keyed by the first of
    ``ACCURACY`` present and draws both. Losses count only for runs without ``REWARD``.
    """
    logged = {k for m in metrics for k, v in m.items() if v}
    offline = {k for m in metrics if not m.get(REWARD) for k, v in m.items() if v}
    groups: list[list[str]] = [
        [REWARD],
        list(ACCURACY),
        _kl_candidates(logged),
        list(ENTROPY_OR_CLIPFRAC),
    ]
    chosen = [next(k for k in g if k in logged) for g in groups if any(k in logged for k in g)]
    chosen += [k for k in OFFLINE_LOSSES if k in offline]
    return chosen[:MAX_PANELS]


def panel_series(panel: str) -> list[tuple[str, str]]:
    """The ``(column, linestyle)`` pairs drawn in ``panel``: both accuracies, else the key itself."""
    if panel in ACCURACY:
        return [(ACCURACY[0], "-"), (ACCURACY[1], "--")]
    return [(panel, "-")]


def trailing_mean(values: list[float], window: int) -> list[float]:
    """Trailing moving average: ``out[i]`` is the mean of ``values[max(0, i - window + 1) : i + 1]``.

    Shape: ``values`` (n,) -> (n,); ``window <= 1`` returns the values unchanged.
    """
    w = max(window, 1)
    return [sum(values[max(0, i - w + 1) : i + 1]) / min(i + 1, w) for i in range(len(values))]


def run_label(run_dir: Path) -> str:
    """``"<name> (<algo>, seed <seed>)"`` from ``config.yaml``; the directory name without one."""
    try:
        cfg: Any = yaml.safe_load((Path(run_dir) / CONFIG_FILE).read_text())
    except (OSError, yaml.YAMLError):
        cfg = None
    if not isinstance(cfg, dict) or "name" not in cfg:
        return Path(run_dir).resolve().name
    algo = cfg.get("algo", {}).get("name") if isinstance(cfg.get("algo"), dict) else None
    extra = ", ".join(str(x) for x in (algo, None if cfg.get("seed") is None else f"seed {cfg['seed']}") if x)
    return f"{cfg['name']} ({extra})" if extra else str(cfg["name"])


def unique_labels(labels: list[str], run_dirs: list[Path]) -> list[str]:
    """``labels`` with ``[parent/dir]`` appended to those that occur more than once."""
    return [
        f"{lab} [{Path(d).resolve().parent.name}/{Path(d).resolve().name}]" if labels.count(lab) > 1 else lab
        for lab, d in zip(labels, run_dirs)
    ]


def plot_runs(run_dirs: list[Path], out: Path, title: str | None = None, smooth: int = 10) -> Path:
    """Draw the runs' chosen ``panels`` into one PNG at ``out`` (parents created); returns ``out``.

    Training curves are smoothed with ``trailing_mean(.., smooth)``; ``eval/*`` panels are raw.
    Raises FileNotFoundError for a dir without ``metrics.csv``, ValueError when no run has a
    plottable metric.
    """
    metrics = [read_metrics(Path(d)) for d in run_dirs]
    keys = panels(metrics)
    if not keys:
        found = sorted({k for m in metrics for k in m})
        raise ValueError(f"no plottable metrics in {[str(d) for d in run_dirs]}; columns found: {found}")
    labels = unique_labels([run_label(Path(d)) for d in run_dirs], list(run_dirs))
    try:
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
    except ImportError as err:
        raise ImportError("plotting needs matplotlib: pip install matplotlib") from err

    ncols = min(len(keys), 2)
    nrows = math.ceil(len(keys) / ncols)
    # A bare Figure (no pyplot): no backend is chosen or changed, so a notebook's inline plots and
    # a user's own figures are left alone.
    fig = Figure(figsize=(6 * ncols, 3.8 * nrows))
    axes = fig.subplots(nrows, ncols, squeeze=False)
    flat = list(axes.flat)
    for ax, key in zip(flat, keys):
        series = panel_series(key)
        for i, m in enumerate(metrics):
            for col, style in [(c, st) for c, st in series if m.get(c)]:
                steps, values = zip(*m[col])
                ys = list(values) if col.startswith("eval/") else trailing_mean(list(values), smooth)
                ax.plot(steps, ys, color=f"C{i}", linestyle=style)
        ax.set_title("eval/accuracy (solid: sampled, dashed: greedy)" if len(series) > 1 else key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in flat[len(keys) :]:
        ax.set_visible(False)
    # Proxy handles: every run is in the legend, even one with nothing in the first panel.
    handles = [Line2D([], [], color=f"C{i}") for i in range(len(labels))]
    flat[0].legend(handles, labels, fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=100)
    return out


def default_out(run_dirs: list[Path]) -> Path:
    """``RUN_DIR/plots.png`` for one run, ``./compare.png`` for several."""
    return Path(run_dirs[0]) / PLOT_FILE if len(run_dirs) == 1 else Path("compare.png")


def main(argv: list[str] | None = None) -> None:
    """The CLI: plot the runs, print the PNG's path; ``error: ...`` and exit 1 on a bad run dir."""
    parser = argparse.ArgumentParser(
        prog="python -m rlhf_lightning.plot", description="Plot training runs from their run directories."
    )
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR")
    parser.add_argument("--out", type=Path, help="PNG to write (default: RUN_DIR/plots.png or ./compare.png)")
    parser.add_argument("--title", help="figure title")
    parser.add_argument("--smooth", type=int, default=10, help="trailing moving average window (1: raw)")
    args = parser.parse_args(argv)
    if args.smooth < 1:
        parser.error("--smooth must be >= 1")
    try:
        path = plot_runs(args.run_dirs, args.out or default_out(args.run_dirs), args.title, args.smooth)
    except (FileNotFoundError, ValueError, ImportError) as err:
        raise SystemExit(f"error: {err}") from None
    print(path)


if __name__ == "__main__":
    main()
