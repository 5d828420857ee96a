"""Evolution vs search: training steps to a target held-out accuracy, from a poor learning rate.

    .venv/bin/python bench/population.py --seeds 0 1 2 --plot docs/population_vs_optuna.png   # ~1 h on 2 cores

Two arms on the default arithmetic task (tiny model, GRPO, 16 prompts x 8 per step), both
starting from ``--init-lr`` (deliberately poor) over the same space, lr in [1e-5, 1e-2]:

- **population**: one run of ``--members`` LoRA members on one base, all at ``--init-lr``,
  side by side (``population.batched=true``: one rollout for all members and an update of each
  per training step; ``--round-robin``: one member per training step), evolved every
  ``--evolve-every`` member updates of each member x members (fitness: accuracy by ``--metric``, greedy by default,
  on the first ``--eval-rows`` held-out problems; tournament selection with elitism; lr mutated x2 or /2). Steps to target:
  the global step (all members together) of the first evolution whose best fitness reaches
  ``--target``.
- **optuna**: a TPE search (seeded), whose first trial is ``--init-lr``; each trial is a full
  run of ``--trial-steps`` steps, evaluated greedily on the same held-out problems every
  ``--eval-every`` steps. Steps to target: the steps of every earlier trial plus those of the
  first evaluation that reaches ``--target``.

Each (arm, seed) runs in its own process, ``--parallel`` at a time with one thread each; the
result is a markdown table (and ``--json``, ``--plot``): member updates (optimizer steps of all
members or trials together) and wall time to the target, model loading included. Both arms get
the same budget of member updates: ``--budget`` for the population, ``--max-trials x
--trial-steps`` for the search.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LR_LOW, LR_HIGH = 1e-5, 1e-2


# What a benchmark run needs none of: evaluation outside its own, checkpoints, exports, sample
# tables, the progress bar.
QUIET_RUN = [
    "eval.before_training=false",
    "eval.at_end=false",
    "checkpoint.every_n_steps=0",
    "checkpoint.save_last=false",
    "checkpoint.export_adapters=false",
    "checkpoint.monitor=null",
    "samples.every_n_steps=0",
    "trainer.enable_progress_bar=false",
]


def overrides(args: argparse.Namespace, seed: int, out: Path) -> list[str]:
    """What both arms share: the default task, one thread, evaluation (``--metric``) on the same rows."""
    return [
        f"seed={seed}",
        "num_threads=1",
        f"env.kwargs.eval_size={args.eval_rows}",
        f"eval.batch_size={args.eval_rows}",
        f"eval.sampled={args.metric == 'sampled'}",
        f"eval.greedy={args.metric == 'greedy'}",
        *QUIET_RUN,
        f"output_dir={out}",
    ]


def compose(extra: list[str]) -> Any:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from rlhf_lightning.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return hydra_compose(config_name="config", overrides=extra)


def rows(path: Path) -> list[dict[str, str]]:
    return list(csv.DictReader(path.open())) if path.is_file() else []


def clock(t0: float) -> Any:
    """A callback keeping the wall time since ``t0`` at the end of every training step and every
    evaluation, by global step (member updates)."""
    import lightning as L

    class Clock(L.Callback):
        def __init__(self) -> None:
            self.at: dict[int, float] = {}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
            self.at[trainer.global_step] = time.time() - t0

        def on_validation_end(self, trainer, pl_module):  # type: ignore[no-untyped-def]
            self.at[trainer.global_step] = time.time() - t0

    return Clock()


def population_arm(args: argparse.Namespace, seed: int, out: Path) -> dict[str, Any]:
    import lightning as L

    from rlhf_lightning.run import run

    class StopAtTarget(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
            best = trainer.callback_metrics.get("population/fitness_best")
            if best is not None and float(best) >= args.target:
                trainer.should_stop = True

    space = f"{{lr:{{low:{LR_LOW},high:{LR_HIGH},scale:2.0}}}}"
    cfg = compose(
        [
            *overrides(args, seed, out),
            f"algo.lr={args.init_lr}",
            f"population.size={args.members}",
            f"population.batched={not args.round_robin}",
            # member updates between evolutions the same either way: population steps side by side
            f"population.evolve_every={args.evolve_every if args.round_robin else args.evolve_every // args.members}",
            f"population.fitness=accuracy_{args.metric}",
            f"population.eval_rows={args.eval_rows}",
            f"population.mutate={space}",
            f"trainer.max_steps={args.budget}",
            f"trainer.val_check_interval={args.budget + 1}",
        ]
    )
    t0 = time.time()
    clk = clock(t0)
    run(cfg, extra_callbacks=[StopAtTarget(), clk])
    curve = [
        (int(r["step"]), float(r["population/fitness_best"]), float(r["population/best_lr"]))
        for r in rows(out / "metrics.csv")
        if r.get("population/fitness_best")
    ]
    reached = next((s for s, f, _ in curve if f >= args.target), None)
    wall_to_target = clk.at.get(reached) if reached is not None else None
    return {"arm": "population", "seed": seed, "steps_to_target": reached, "steps_run": curve[-1][0] if curve else 0,
            "wall_s": time.time() - t0, "wall_to_target_s": wall_to_target, "curve": curve,
            "times": [clk.at.get(s) for s, _, _ in curve], "lineage": rows(out / "lineage.csv")}  # fmt: skip


def optuna_arm(args: argparse.Namespace, seed: int, out: Path) -> dict[str, Any]:
    import optuna

    from rlhf_lightning.run import run

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=seed))
    study.enqueue_trial({"lr": args.init_lr})
    spent, reached, trials, wall_to_target = 0, None, [], None
    t0 = time.time()
    for i in range(args.max_trials):
        trial = study.ask()
        lr = trial.suggest_float("lr", LR_LOW, LR_HIGH, log=True)
        trial_dir = out / f"trial_{i}"
        cfg = compose(
            [
                *overrides(args, seed, trial_dir),
                f"algo.lr={lr}",
                f"trainer.max_steps={args.trial_steps}",
                f"trainer.val_check_interval={args.eval_every}",
            ]
        )
        clk = clock(t0)
        run(cfg, extra_callbacks=[clk])
        key = f"eval/accuracy_{args.metric}"
        curve = [(int(r["step"]), float(r[key])) for r in rows(trial_dir / "metrics.csv") if r.get(key)]
        hit = next((s for s, a in curve if a >= args.target), None)
        trials.append({"lr": lr, "curve": curve, "hit": hit, "times": [clk.at.get(s) for s, _ in curve]})
        if hit is not None:
            reached, wall_to_target = spent + hit, clk.at.get(hit)
            break
        spent += args.trial_steps
        study.tell(trial, curve[-1][1] if curve else 0.0)
    return {"arm": "optuna", "seed": seed, "steps_to_target": reached, "steps_run": spent + (trials[-1]["hit"] or 0),
            "wall_s": time.time() - t0, "wall_to_target_s": wall_to_target, "trials": trials}  # fmt: skip


def worker(args: argparse.Namespace) -> None:
    out = Path(args.work) / f"{args.arm}_{args.seed}"
    fn = population_arm if args.arm == "population" else optuna_arm
    result = fn(args, args.seed, out)
    (out.parent / f"{args.arm}_{args.seed}.json").write_text(json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--arms", nargs="+", default=["population", "optuna"])
    ap.add_argument("--target", type=float, default=0.50, help="held-out accuracy (--metric) to reach")
    ap.add_argument("--metric", choices=["greedy", "sampled"], default="greedy", help="target and fitness")
    ap.add_argument(
        "--init-lr", type=float, default=1e-4, help="the poor starting lr (the tuned one is 1e-3)"
    )
    ap.add_argument("--members", type=int, default=4)
    ap.add_argument("--round-robin", action="store_true", help="one member per training step (the old way)")
    ap.add_argument("--evolve-every", type=int, default=40)
    ap.add_argument("--budget", type=int, default=2800, help="population: global steps at most")
    ap.add_argument("--trial-steps", type=int, default=700)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--max-trials", type=int, default=4)
    ap.add_argument("--eval-rows", type=int, default=200)
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--work", default="outputs/bench_population")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--arm", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    Path(args.work).mkdir(parents=True, exist_ok=True)
    shared = sys.argv[1:]
    jobs = [(arm, seed) for seed in args.seeds for arm in args.arms]

    def launch(job: tuple[str, int]) -> dict[str, Any]:
        arm, seed = job
        cmd = [sys.executable, __file__, *shared, "--worker", "--arm", arm, "--seed", str(seed)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        log = Path(args.work) / f"{arm}_{seed}.log"
        with log.open("w") as f:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT).returncode
        if rc != 0:
            raise SystemExit(f"{arm} seed {seed} failed (rc {rc}): see {log}")
        return dict(json.loads((Path(args.work) / f"{arm}_{seed}.json").read_text()))

    with ThreadPoolExecutor(args.parallel) as pool:
        results = list(pool.map(launch, jobs))
    report(args, results)


def report(args: argparse.Namespace, results: list[dict[str, Any]]) -> None:
    print(
        f"target: held-out {args.metric} accuracy >= {args.target} on {args.eval_rows} problems; start lr {args.init_lr}"
    )
    print("| arm | seed | member updates to target | wall s to target | wall s run | how |")
    print("|---|---|---|---|---|---|")
    for r in results:
        if r["arm"] == "population":
            lrs = sorted({float(x["lr"]) for x in r["lineage"] if x["lr"]})
            how = f"{args.members} members, lrs tried {', '.join(f'{v:.0e}' for v in lrs)}"
        else:
            how = "trials: " + ", ".join(
                f"lr {t['lr']:.1e}" + (f" hit @{t['hit']}" if t["hit"] else "") for t in r["trials"]
            )
        steps = (
            r["steps_to_target"] if r["steps_to_target"] is not None else f"not reached in {r['steps_run']}"
        )
        wall = r.get("wall_to_target_s")
        shown = f"{wall:.0f}" if wall is not None else "not reached"
        print(f"| {r['arm']} | {r['seed']} | {steps} | {shown} | {r['wall_s']:.0f} | {how} |")
    for arm in args.arms:
        got = [r for r in results if r["arm"] == arm]
        done = [r["steps_to_target"] for r in got if r["steps_to_target"] is not None]
        walls = [r["wall_to_target_s"] for r in got if r.get("wall_to_target_s") is not None]
        mean = sum(done) / len(done) if done else math.nan
        mean_wall = sum(walls) / len(walls) if walls else math.nan
        print(
            f"{arm}: reached in {len(done)}/{len(got)} seeds, mean member updates {mean:.0f}, mean wall s {mean_wall:.0f}"
        )
    by_seed = {(r["arm"], r["seed"]): r.get("wall_to_target_s") for r in results}
    if set(args.arms) == {"population", "optuna"}:
        wins = sum(
            1
            for s in args.seeds
            if by_seed.get(("population", s)) is not None
            and (by_seed.get(("optuna", s)) is None or by_seed[("population", s)] < by_seed[("optuna", s)])
        )
        print(
            f"evolution reached the target in less wall time than the search on {wins} of {len(args.seeds)} seeds"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
    if args.plot:
        plot(args, results)


def plot(args: argparse.Namespace, results: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for r in results:
        pop = r["arm"] == "population"
        if pop:
            xs, ys, ts = [c[0] for c in r["curve"]], [c[1] for c in r["curve"]], r.get("times", [])
        else:
            xs, ys, ts, spent = [], [], [], 0
            for t in r["trials"]:
                xs += [spent + s for s, _ in t["curve"]]
                ys += [a for _, a in t["curve"]]
                ts += t.get("times", [])
                spent += args.trial_steps
        style = (
            {"color": "C0", "marker": "o", "ms": 3}
            if pop
            else {"color": "C1", "ls": "--", "marker": ".", "ms": 3}
        )
        label = f"{'population' if pop else 'optuna'} seed {r['seed']}"
        axes[0].plot(xs, ys, label=label, **style)
        if ts and all(t is not None for t in ts):
            axes[1].plot(ts, ys, label=label, **style)
    for ax, xlabel in zip(axes, ("member updates (all members / trials together)", "wall time, s")):
        ax.axhline(args.target, color="grey", lw=0.8)
        ax.set(xlabel=xlabel, ylim=(0, 1))
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"held-out {args.metric} accuracy (best member)")
    axes[0].legend(fontsize=7, ncol=2)
    fig.suptitle(
        f"from lr {args.init_lr:g}: evolution ({'round-robin' if args.round_robin else 'side by side'}) vs Optuna"
    )
    fig.tight_layout()
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.plot, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
