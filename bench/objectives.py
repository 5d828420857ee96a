"""The policy objectives side by side on the default task: GRPO's clipped ratio (``ppo_clip``)
against the newer trust regions, each over the same seeds and budget.

    .venv/bin/python bench/objectives.py --losses ppo_clip dppo_tv dppo_kl sapo gmpo kl_cov \
        --seeds 0 1 2 --steps 300 --jobs 2 --out outputs/bench_objectives

Every run is ``python train.py algo.loss=<loss> seed=<s>`` with the default run's settings
(GRPO on the embedded arithmetic model, 16 prompts x 8, LoRA at lr 1e-3) and ``--steps``
updates, one thread each, ``--jobs`` at a time. Only the objective differs: each keeps its own
parameters' defaults and the default aggregation (``token_mean``). Each rollout batch is reused
for 4 optimizer steps (``algo.mini_batch_size=32`` of 128 episodes, ``--args``): with one step
per batch every ratio is 1, where all these objectives have the same gradient as REINFORCE's
(GMPO's differs only in weighting a sequence's tokens), and the comparison would show nothing. Prints, per objective, held-out
accuracy (sampled, greedy) at the end as mean and standard deviation over the seeds, the gain
over the start, and the mean wall time of a run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from a checkout

from bench.learning import evals  # noqa: E402
from rlhf_lightning.plot import read_metrics  # noqa: E402


def one(
    out: Path, loss: str, seed: int, steps: int, extra: list[str]
) -> tuple[dict[str, float], dict[str, float], float]:
    cmd = [
        sys.executable,
        str(ROOT / "train.py"),
        f"algo.loss={loss}",
        f"seed={seed}",
        "num_threads=1",
        f"trainer.max_steps={steps}",
        f"trainer.val_check_interval={steps}",
        "trainer.enable_progress_bar=false",
        "overwrite=true",
        f"output_dir={out}",
        *extra,
    ]
    t0 = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"{loss} seed {seed} failed")
    ev = evals(read_metrics(out))
    return ev[0], ev[-1], time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--losses", nargs="+", default=["ppo_clip", "dppo_tv", "dppo_kl", "sapo", "gmpo", "kl_cov"]
    )
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench_objectives")
    ap.add_argument(
        "--args",
        nargs="*",
        default=["algo.mini_batch_size=32"],
        help="overrides for every run (default: 4 optimizer steps per rollout batch, so ratios leave 1)",
    )
    a = ap.parse_args()
    jobs = [(loss, seed) for loss in a.losses for seed in a.seeds]
    with ThreadPoolExecutor(a.jobs) as pool:
        done = list(
            pool.map(lambda j: one(a.out.resolve() / f"{j[0]}_seed{j[1]}", j[0], j[1], a.steps, a.args), jobs)
        )
    results = dict(zip(jobs, done, strict=True))
    print(
        f"| objective | sampled at {a.steps} (mean +- sd) | gain | greedy at {a.steps} (mean +- sd) "
        "| per seed (sampled) | wall s per run |"
    )
    print("|---|---:|---:|---:|---|---:|")
    for loss in a.losses:
        runs = [results[(loss, s)] for s in a.seeds]
        sampled = [last["sampled"] for _, last, _ in runs]
        greedy = [last["greedy"] for _, last, _ in runs]
        gain = statistics.mean(last["sampled"] - first["sampled"] for first, last, _ in runs)
        sd = statistics.stdev if len(runs) > 1 else (lambda xs: 0.0)
        print(
            f"| `{loss}` | {statistics.mean(sampled):.3f} +- {sd(sampled):.3f} | {gain:+.3f} "
            f"| {statistics.mean(greedy):.3f} +- {sd(greedy):.3f} | {', '.join(f'{x:.3f}' for x in sampled)} "
            f"| {statistics.mean(w for _, _, w in runs):.0f} |"
        )


if __name__ == "__main__":
    main()
