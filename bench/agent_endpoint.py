"""What the policy endpoint costs: the same calculator episodes driven by the harness
(``experiment=tool_use``: env=tools) and by an agent program through the endpoint
(``experiment=agent_calc``: env=agent, examples/agent_calc/agent.py), side by side in one run.

    OMP_NUM_THREADS=1 .venv/bin/python bench/agent_endpoint.py --steps 8 --out outputs/bench/agent_endpoint

Both use model=tiny_tools, the same problems' prompt and calculator schema, 8 prompts x 8
episodes, rollout.max_new_tokens=40, one thread, no evaluation; the runs alternate (harness,
agent, harness, agent). Reported per side: the median over steps (the first dropped: start-up)
of perf/step_s and perf/rollout_s, the calls per episode and, for the agent sides, the batched
engine calls per step; the agent side runs with 8 and with 32 agents at once (env.concurrency:
each agent is a worker process, and a batch holds at most that many requests), with the default
``env.kwargs.batching=rounds`` (a round's calls in one engine call, in a fixed order) and, at 32,
with ``window`` (the calls that arrive within 10 ms of the first).
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMON = [
    "num_threads=1",
    "seed=0",
    "algo.prompts_per_step=8",
    "algo.group_size=8",
    "rollout.max_new_tokens=40",
    "eval.before_training=false",
    "eval.at_end=false",
    "trainer.val_check_interval=1000",
    "trainer.enable_progress_bar=false",
    "checkpoint.every_n_steps=0",
    "checkpoint.save_last=false",
    "samples.every_n_steps=0",
    "overwrite=true",  # a rerun replaces the last one's directories
]
SIDES = {
    "harness": ["experiment=tool_use"],
    "endpoint (8 agents at once)": ["experiment=agent_calc", "env.concurrency=8"],
    "endpoint (32 agents at once)": ["experiment=agent_calc", "env.concurrency=32"],
    "endpoint (32 at once, batching=window)": [
        "experiment=agent_calc",
        "env.concurrency=32",
        "env.kwargs.batching=window",
    ],
}


def train(out: Path, overrides: list[str], steps: int) -> list[dict[str, str]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    args = [*overrides, *COMMON, f"trainer.max_steps={steps}", f"output_dir={out.resolve()}"]
    proc = subprocess.run(
        [sys.executable, "train.py", *args], cwd=ROOT, env=env, capture_output=True, text=True
    )
    if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"train.py {' '.join(overrides)} failed")
    with open(out / "metrics.csv", newline="") as f:
        return [r for r in csv.DictReader(f) if r.get("perf/step_s")]


def median(rows: list[dict[str, str]], key: str) -> float:
    values = [float(r[key]) for r in rows[1:] if r.get(key)]
    return statistics.median(values) if values else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("outputs/bench/agent_endpoint"))
    args = ap.parse_args()
    rows: dict[str, list[dict[str, str]]] = {side: [] for side in SIDES}
    for r in range(args.repeats):
        for side, overrides in SIDES.items():
            rows[side] += train(
                args.out / f"{side.split()[0]}_{overrides[-1].split('=')[-1]}_{r}", overrides, args.steps
            )
    print("| driven by | step s (median) | rollout s (median) | calls per episode | engine calls per step |")
    print("|---|---:|---:|---:|---:|")
    for side, got in rows.items():
        agent = side.startswith("endpoint")
        calls = median(got, "agent/calls_per_episode" if agent else "rollout/num_turns")
        engine = f"{median(got, 'agent/engine_calls'):.1f}" if agent else "one per turn"
        print(
            f"| {side} | {median(got, 'perf/step_s'):.2f} | {median(got, 'perf/rollout_s'):.2f} "
            f"| {calls:.2f} | {engine} |"
        )


if __name__ == "__main__":
    main()
