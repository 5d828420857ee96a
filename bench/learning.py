"""Does RL improve the held-out accuracy? Runs train.py per algorithm and seed, side by side.

    .venv/bin/python bench/learning.py                       # grpo and cispo, seed 0, default budget
    .venv/bin/python bench/learning.py --algos grpo --seeds 0 1 2 --args trainer.max_steps=400

Prints one markdown table: eval accuracy (sampled at the training temperature, and greedy)
before the first update and at the end, the gain, the wall time of the whole run, and for
actor-critic runs the critic's explained variance (mean over the last 50 training steps).
"""

from __future__ import annotations

import argparse
import csv
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def evals(run_dir: Path) -> list[dict[str, float]]:
    rows = csv.DictReader((run_dir / "metrics.csv").open())
    return [
        {
            "step": float(r["step"]),
            "sampled": float(r["eval/accuracy_sampled"]),
            "greedy": float(r["eval/accuracy_greedy"]),
        }
        for r in rows
        if r.get("eval/accuracy_sampled")
    ]


def last_mean(run_dir: Path, key: str, n: int = 50) -> float | None:
    """Mean of the last ``n`` logged values of ``key`` (None when it was never logged)."""
    with (run_dir / "metrics.csv").open() as f:
        values = [float(r[key]) for r in csv.DictReader(f) if r.get(key)]
    return sum(values[-n:]) / len(values[-n:]) if values else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--algos", nargs="+", default=["grpo", "cispo"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--args", nargs="*", default=[], help="extra overrides for every run")
    ap.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench_learning")
    a = ap.parse_args()
    print(
        "| algo | seed | sampled before | sampled after | gain | greedy before | greedy after | wall s "
        "| critic EV |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for algo in a.algos:
        for seed in a.seeds:
            out = a.out / f"{algo}_seed{seed}"
            cmd = [
                sys.executable,
                str(ROOT / "train.py"),
                f"algo={algo}",
                f"seed={seed}",
                f"output_dir={out}",
                "trainer.enable_progress_bar=false",
                *a.args,
            ]
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            wall = time.perf_counter() - t0
            if proc.returncode != 0:
                print(proc.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"{algo} seed {seed} failed")
            ev = evals(out)
            first, last = ev[0], ev[-1]
            ev_critic = last_mean(out, "critic/explained_variance")
            print(
                f"| {algo} | {seed} | {first['sampled']:.3f} | {last['sampled']:.3f} | {last['sampled'] - first['sampled']:+.3f} "
                f"| {first['greedy']:.3f} | {last['greedy']:.3f} | {wall:.0f} "
                f"| {'-' if ev_critic is None else f'{ev_critic:.3f}'} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
