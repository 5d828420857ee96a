"""A population step side by side against a single run's step, on the default task.

    .venv/bin/python bench/population_step.py                       # N = 2 4 8, 2 threads, ~10 min
    .venv/bin/python bench/population_step.py --members 4 --steps 6 --repeats 3

Every arm is a real training run (``train.py``'s ``run``) of the default config (GRPO, tiny model
with a LoRA actor, 32 prompts x group 8, 8 new tokens): the single run (``population.size=1``)
and ``population.batched=true`` with N members (no evolution, so only steps are timed). The
time of a step is the module's own ``perf/step_s`` (rollout, log-probs, advantages and every
member's update), the median over ``--steps`` steps after the first. The arms alternate in
each of ``--repeats`` rounds, so they share the machine's state; the table gives the median of
the rounds and the ratio to the single run's step. For reference, N steps of one member each
(round-robin, ``population.batched=false``) cost N single steps by construction.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from a checkout
sys.path.insert(0, str(ROOT / "bench"))

from population import QUIET_RUN, compose  # noqa: E402  (bench/population.py)


def step_times(members: int, steps: int, threads: int, work: Path) -> list[float]:
    """``perf/step_s`` of every training step of one run with ``members`` (1: a single run)."""
    from rlhf_lightning.run import run

    out = Path(tempfile.mkdtemp(dir=work))
    extra = [f"population.size={members}", "population.batched=true", "population.evolve_every=0"]
    overrides = [
        *(extra if members > 1 else []),
        f"trainer.max_steps={steps * members}",  # member updates: steps population steps
        f"num_threads={threads}",
        "trainer.val_check_interval=100000",
        *QUIET_RUN,
        f"output_dir={out}",
    ]
    run(compose(overrides))
    with (out / "metrics.csv").open() as f:
        return [float(r["perf/step_s"]) for r in csv.DictReader(f) if r.get("perf/step_s")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--members", nargs="+", type=int, default=[2, 4, 8])
    ap.add_argument("--steps", type=int, default=5, help="training steps per run (the first is not counted)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", default="outputs/bench_population_step")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    arms = [1, *a.members]
    rounds: dict[int, list[float]] = {n: [] for n in arms}
    for _ in range(a.repeats):
        for n in arms:
            times = step_times(n, a.steps, a.threads, work)
            rounds[n].append(statistics.median(times[1:]))
    single = statistics.median(rounds[1])
    print(f"population step against a single run's step: default task, {a.threads} threads, "
          f"median of {a.repeats} rounds x {a.steps - 1} steps")  # fmt: skip
    print("| members | step s | x single step | per member update, x single step |")
    print("|---:|---:|---:|---:|")
    for n in arms:
        s = statistics.median(rounds[n])
        label = "1 (single run)" if n == 1 else str(n)
        print(f"| {label} | {s:.3f} | {s / single:.2f}x | {s / single / n:.2f}x |")


if __name__ == "__main__":
    main()
