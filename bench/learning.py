"""Does RL improve the held-out accuracy? Runs train.py per algorithm and seed, side by side.

    .venv/bin/python bench/learning.py                       # grpo and cispo, seed 0, default budget
    .venv/bin/python bench/learning.py --algos grpo --seeds 0 1 2 --args trainer.max_steps=400

Prints one markdown table: eval accuracy (sampled at the training temperature, and greedy)
before the first update and at the end, the gain, the wall time of the whole run, turns per
episode (mean over the first and the last 50 training steps) and, for actor-critic runs, the
critic's explained variance (mean over the last 50 training steps). ``--plot`` also draws eval
accuracy against training steps for every run into one PNG.

    .venv/bin/python bench/learning.py --algos grpo ppo --args experiment=tool_calc --plot tool_calc.png

``--metrics KEY ...`` adds a column per logged metric with its first and last value (e.g.
``eval/env_valid_move_sampled`` from ``eval.info_metrics=[valid_move]``; a training metric such as
``env/valid_move`` shows the mean of its first and last 50 steps).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from a checkout

from rlhf_lightning.plot import Metrics, read_metrics  # noqa: E402


def evals(metrics: Metrics) -> list[dict[str, float]]:
    """The evaluations: step, sampled and greedy accuracy (logged in the same rows)."""
    pairs = zip(metrics["eval/accuracy_sampled"], metrics["eval/accuracy_greedy"], strict=True)
    return [{"step": s, "sampled": v, "greedy": g} for (s, v), (_, g) in pairs]


def window_mean(metrics: Metrics, key: str, n: int = 50, first: bool = False) -> float | None:
    """Mean of the last (or first) ``n`` logged values of ``key`` (None when never logged)."""
    values = [v for _, v in metrics.get(key, [])]
    window = values[:n] if first else values[-n:]
    return sum(window) / len(window) if window else None


def first_last(metrics: Metrics, key: str) -> str:
    """``first / last`` of an eval metric, or of a training metric's first and last 50 steps."""
    values = [v for _, v in metrics.get(key, [])]
    if not values:
        return "-"
    if key.startswith("eval/"):
        return f"{values[0]:.3f} / {values[-1]:.3f}"
    return f"{window_mean(metrics, key, first=True):.3f} / {window_mean(metrics, key):.3f}"


def plot(
    curves: dict[str, list[dict[str, float]]], path: Path, title: str, ylabel: str = "held-out success"
) -> None:
    """Eval accuracy (sampled: solid, greedy: dashed) against training steps, one colour per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, (name, ev) in enumerate(curves.items()):
        steps = [e["step"] for e in ev]
        ax.plot(steps, [e["sampled"] for e in ev], color=f"C{i}", marker="o", ms=3, label=f"{name} sampled")
        ax.plot(steps, [e["greedy"] for e in ev], color=f"C{i}", ls="--", alpha=0.7, label=f"{name} greedy")
    ax.set(xlabel="training step", ylabel=ylabel, title=title, ylim=(0, 1))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--algos", nargs="+", default=["grpo", "cispo"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--args", nargs="*", default=[], help="extra overrides for every run")
    ap.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench_learning")
    ap.add_argument("--plot", type=Path, default=None, help="write eval-vs-steps curves to this PNG")
    ap.add_argument("--title", default="held-out success during training")
    ap.add_argument("--metrics", nargs="*", default=[], help="logged metrics to show first / last")
    a = ap.parse_args()
    print(
        "| algo | seed | sampled before | sampled after | gain | greedy before | greedy after | wall s "
        "| turns first / last | critic EV |" + "".join(f" {k} first / last |" for k in a.metrics)
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(a.metrics))
    curves: dict[str, list[dict[str, float]]] = {}
    for algo in a.algos:
        for seed in a.seeds:
            out = a.out / f"{algo}_seed{seed}"
            cmd = [
                sys.executable,
                str(ROOT / "train.py"),
                f"algo={algo}",
                f"seed={seed}",
                f"output_dir={out}",
                "overwrite=true",  # a re-run replaces its own earlier run
                "trainer.enable_progress_bar=false",
                *a.args,
            ]
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            wall = time.perf_counter() - t0
            if proc.returncode != 0:
                print(proc.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"{algo} seed {seed} failed")
            metrics = read_metrics(out)
            ev = evals(metrics)
            first, last = ev[0], ev[-1]
            curves[f"{algo} seed {seed}"] = ev
            ev_critic = window_mean(metrics, "critic/explained_variance")
            turns = (
                window_mean(metrics, "rollout/num_turns", first=True),
                window_mean(metrics, "rollout/num_turns"),
            )
            print(
                f"| {algo} | {seed} | {first['sampled']:.3f} | {last['sampled']:.3f} | {last['sampled'] - first['sampled']:+.3f} "
                f"| {first['greedy']:.3f} | {last['greedy']:.3f} | {wall:.0f} "
                f"| {turns[0] or 0:.2f} / {turns[1] or 0:.2f} "
                f"| {'-' if ev_critic is None else f'{ev_critic:.3f}'} |"
                + "".join(f" {first_last(metrics, k)} |" for k in a.metrics),
                flush=True,
            )
    if a.plot is not None:
        plot(curves, a.plot, a.title)
        print(f"\nplot: {a.plot}")


if __name__ == "__main__":
    main()
