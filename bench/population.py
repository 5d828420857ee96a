"""Evolution against a search at equal compute: member updates to a target held-out accuracy.

    .venv/bin/python bench/population.py --seeds 0 1 2 --plot docs/population_vs_optuna.png   # ~1.5 h on 2 cores

Two arms on the default arithmetic task (tiny model, GRPO, 16 prompts x 8 per step), over the
same space: ``lr`` log-uniform in [1e-5, 1e-2] and the training ``temperature`` uniform in
[``--temp-low``, ``--temp-high``] (a value whose best changes as training sharpens the policy).
Both draw their starts from that prior; neither gets a hand-picked value.

- **population**: one run of ``--members`` LoRA members side by side (one rollout for all, an
  update of each per population step), each member's start drawn from the prior
  (``population.init=sample``); every ``--evolve-every`` population steps every member is scored
  on the first ``--eval-rows`` held-out problems at temperature 1 (``population.fitness``), the
  least fit quarter replaced by clones of the fittest (``population.selection=truncation``),
  whose lr or temperature is perturbed (x2 / 1.2) or, one time in four, resampled from the prior.
- **optuna**: a seeded TPE search whose trials are full runs of ``--trial-steps`` steps, evaluated
  on the same held-out problems every ``--evolve-every`` steps; the median pruner stops a trial
  whose evaluation is below the median of earlier trials at that step (as a user would run it),
  and the search goes on with new trials until it has spent its budget.

Equal compute: both arms get ``--trials x --trial-steps`` member updates (optimizer steps of all
members together, or of all trials together): the population runs that many divided by
``--members`` population steps. Steps to target: the member updates spent when an evaluation
first reaches ``--target`` (the population: all members' updates at that scoring; the search:
every earlier trial's steps, pruned ones as far as they ran, plus the hitting trial's). Evaluation
episodes are not counted in either arm; wall time (model loading and evaluation included) is
reported beside. Each (arm, seed) runs in its own process, ``--parallel`` at a time with one
thread each.
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


def budget(args: argparse.Namespace) -> tuple[int, int]:
    """Equal compute: (member updates each arm may spend, the population's population steps)."""
    updates = args.trials * args.trial_steps
    if updates % args.members or (updates // args.members) % args.evolve_every:
        raise SystemExit(
            f"--trials x --trial-steps = {updates} member updates must split into --members={args.members} "
            f"members' runs of whole --evolve-every={args.evolve_every} periods"
        )
    return updates, updates // args.members


def reached(accuracy: float, target: float) -> bool:
    """``accuracy >= target``, counting a logged float32 (90/200 is 0.449999988) as its fraction."""
    return accuracy >= target - 1e-6


def population_steps_to_target(curve: list[tuple[int, float]], target: float) -> int | None:
    """The member updates (all members) at the first scoring whose best fitness reaches ``target``."""
    return next((updates for updates, best in curve if reached(best, target)), None)


def search_steps_to_target(trials: list[dict[str, Any]], target: float) -> int | None:
    """Every earlier trial's steps (as far as each ran: pruned ones stop early) plus the steps of
    the first evaluation that reaches ``target``."""
    spent = 0
    for t in trials:
        hit = next((s for s, a in t["curve"] if reached(a, target)), None)
        if hit is not None:
            return spent + hit
        spent += t["ran"]
    return None


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
        "overwrite=true",  # a re-run replaces its own earlier run
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


def space(args: argparse.Namespace) -> str:
    """``population.mutate``: the space both arms draw from (lr log-uniform, temperature uniform)."""
    return (
        f"{{lr:{{low:{LR_LOW},high:{LR_HIGH},scale:2.0}},"
        f"temperature:{{low:{args.temp_low},high:{args.temp_high},scale:1.2}}}}"
    )


def population_arm(args: argparse.Namespace, seed: int, out: Path) -> dict[str, Any]:
    import lightning as L

    from rlhf_lightning.run import run

    updates, steps = budget(args)

    class StopAtTarget(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
            best = trainer.callback_metrics.get("population/fitness_best")
            if best is not None and reached(float(best), args.target):
                trainer.should_stop = True

    cfg = compose(
        [
            *overrides(args, seed, out),
            f"population.size={args.members}",
            "population.batched=true",
            "population.init=sample",
            "population.selection=truncation",
            "population.resample_prob=0.25",
            f"population.evolve_every={args.evolve_every}",
            f"population.fitness=accuracy_{args.metric}",
            f"population.eval_rows={args.eval_rows}",
            f"population.mutate={space(args)}",
            f"trainer.max_steps={updates}",  # member updates: `steps` population steps
            f"trainer.val_check_interval={updates + 1}",
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
    to_target = population_steps_to_target([(u, f) for u, f, _ in curve], args.target)
    return {"arm": "population", "seed": seed, "steps_to_target": to_target, "steps_run": curve[-1][0] if curve else 0,
            "budget": updates, "population_steps": steps, "wall_s": time.time() - t0,
            "wall_to_target_s": clk.at.get(to_target) if to_target is not None else None, "curve": curve,
            "times": [clk.at.get(u) for u, _, _ in curve], "lineage": rows(out / "lineage.csv")}  # fmt: skip


def optuna_arm(args: argparse.Namespace, seed: int, out: Path) -> dict[str, Any]:
    import lightning as L
    import optuna

    from rlhf_lightning.run import run

    updates, _ = budget(args)
    key = f"eval/accuracy_{args.metric}"

    class Report(L.Callback):
        """Each evaluation goes to the trial; the pruner may stop the run there."""

        def __init__(self, trial: Any) -> None:
            self.trial, self.pruned = trial, False

        def on_validation_end(self, trainer, pl_module):  # type: ignore[no-untyped-def]
            value = trainer.callback_metrics.get(key)
            if value is None or trainer.global_step == 0:
                return
            self.trial.report(float(value), trainer.global_step)
            if reached(float(value), args.target) or self.trial.should_prune():
                self.pruned = not reached(float(value), args.target)
                trainer.should_stop = True

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(
        direction="maximize",
        sampler=optuna.samplers.TPESampler(seed=seed),
        pruner=optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=0),
    )
    spent, trials, wall_to_target = 0, [], None
    t0 = time.time()
    while spent < updates:
        trial = study.ask()
        lr = trial.suggest_float("lr", LR_LOW, LR_HIGH, log=True)
        temperature = trial.suggest_float("temperature", args.temp_low, args.temp_high)
        trial_dir = out / f"trial_{len(trials)}"
        steps = min(args.trial_steps, updates - spent)  # the last trial gets what is left
        cfg = compose(
            [
                *overrides(args, seed, trial_dir),
                f"algo.lr={lr}",
                f"rollout.temperature={temperature}",
                f"trainer.max_steps={steps}",
                f"trainer.val_check_interval={args.evolve_every}",
            ]
        )
        clk, report_cb = clock(t0), Report(trial)
        result = run(cfg, extra_callbacks=[clk, report_cb])
        curve = [(int(r["step"]), float(r[key])) for r in rows(trial_dir / "metrics.csv") if r.get(key)]
        curve = [(s, a) for s, a in curve if s > 0]
        ran = int(result.trainer.global_step)
        hit = next((s for s, a in curve if reached(a, args.target)), None)
        trials.append({"lr": lr, "temperature": temperature, "curve": curve, "hit": hit, "ran": ran,
                       "pruned": report_cb.pruned, "times": [clk.at.get(s) for s, _ in curve]})  # fmt: skip
        if hit is not None:
            wall_to_target = clk.at.get(hit)
            break
        spent += ran
        if report_cb.pruned:
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        else:
            study.tell(trial, curve[-1][1] if curve else 0.0)
    to_target = search_steps_to_target(trials, args.target)
    return {"arm": "optuna", "seed": seed, "steps_to_target": to_target, "budget": updates,
            "steps_run": sum(t["ran"] for t in trials), "wall_s": time.time() - t0,
            "wall_to_target_s": wall_to_target, "trials": trials}  # fmt: skip


def worker(args: argparse.Namespace) -> None:
    out = Path(args.work) / f"{args.arm}_{args.seed}"
    fn = population_arm if args.arm == "population" else optuna_arm
    result = fn(args, args.seed, out)
    (out.parent / f"{args.arm}_{args.seed}.json").write_text(json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--arms", nargs="+", default=["population", "optuna"])
    ap.add_argument("--target", type=float, default=0.45, help="held-out accuracy (--metric) to reach")
    ap.add_argument("--metric", choices=["greedy", "sampled"], default="sampled", help="target and fitness")
    ap.add_argument("--members", type=int, default=4)
    ap.add_argument(
        "--trials", type=int, default=4, help="the budget: --trials x --trial-steps member updates"
    )
    ap.add_argument("--trial-steps", type=int, default=400, help="a search trial's steps (a member's run)")
    ap.add_argument("--evolve-every", type=int, default=50, help="updates of each member between scorings")
    ap.add_argument("--temp-low", type=float, default=0.6)
    ap.add_argument("--temp-high", type=float, default=1.4)
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
    updates, steps = budget(args)
    print(
        f"target: held-out {args.metric} accuracy >= {args.target} on {args.eval_rows} problems; "
        f"budget {updates} member updates each ({args.members} members x {steps} population steps; "
        f"{args.trials} trials x {args.trial_steps} steps)"
    )
    print("| arm | seed | member updates to target | wall s to target | wall s run | how |")
    print("|---|---|---|---|---|---|")
    for r in results:
        if r["arm"] == "population":
            starts = [x for x in r["lineage"] if x["event"] == "init"]
            clones = sum(x["event"] == "clone" for x in r["lineage"])
            how = (
                f"starts lr {', '.join(format(float(x['lr']), '.0e') for x in starts)}; {clones} clones; "
                f"best lr at the end {r['curve'][-1][2]:.1e}"
                if r["curve"]
                else "no scoring"
            )
        else:
            how = "trials: " + ", ".join(
                f"lr {t['lr']:.1e} T {t['temperature']:.2f}"
                + (f" hit @{t['hit']}" if t["hit"] else " pruned @" + str(t["ran"]) if t["pruned"] else "")
                for t in r["trials"]
            )
        steps_to = r["steps_to_target"]
        shown_steps = steps_to if steps_to is not None else f"not reached in {r['steps_run']}"
        wall = r.get("wall_to_target_s")
        shown = f"{wall:.0f}" if wall is not None else "not reached"
        print(f"| {r['arm']} | {r['seed']} | {shown_steps} | {shown} | {r['wall_s']:.0f} | {how} |")
    for arm in args.arms:
        got = [r for r in results if r["arm"] == arm]
        done = [r["steps_to_target"] for r in got if r["steps_to_target"] is not None]
        walls = [r["wall_to_target_s"] for r in got if r.get("wall_to_target_s") is not None]
        mean = sum(done) / len(done) if done else math.nan
        mean_wall = sum(walls) / len(walls) if walls else math.nan
        print(
            f"{arm}: reached in {len(done)}/{len(got)} seeds, mean member updates {mean:.0f}, mean wall s {mean_wall:.0f}"
        )
    if set(args.arms) == {"population", "optuna"}:
        wins = evolution_wins(results, args.seeds)
        print(
            f"evolution reached the target in fewer member updates than the search on {wins} of {len(args.seeds)} seeds"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
    if args.plot:
        plot(args, results)


def evolution_wins(results: list[dict[str, Any]], seeds: list[int]) -> int:
    """Seeds on which the population reached the target in fewer member updates than the search
    (or reached it and the search did not)."""
    by = {(r["arm"], r["seed"]): r["steps_to_target"] for r in results}
    return sum(
        1
        for s in seeds
        if by.get(("population", s)) is not None
        and (by.get(("optuna", s)) is None or by[("population", s)] < by[("optuna", s)])
    )


def search_curve(r: dict[str, Any]) -> tuple[list[int], list[float], list[float | None]]:
    """The search's best evaluation so far against the member updates spent (trials one after
    the other, each as far as it ran), and the wall times."""
    xs: list[int] = []
    ys: list[float] = []
    ts: list[float | None] = []
    spent, best = 0, 0.0
    for t in r["trials"]:
        for (s, a), w in zip(t["curve"], t.get("times") or [None] * len(t["curve"]), strict=True):
            best = max(best, a)
            xs.append(spent + s)
            ys.append(best)
            ts.append(w)
        spent += t["ran"]
    return xs, ys, ts


def plot(args: argparse.Namespace, results: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.4))
    for r in results:
        pop = r["arm"] == "population"
        if pop:
            xs, ys, ts = [c[0] for c in r["curve"]], [c[1] for c in r["curve"]], r.get("times", [])
        else:
            xs, ys, ts = search_curve(r)
        color = f"C{args.seeds.index(r['seed']) if r['seed'] in args.seeds else 0}"
        style = {"color": color, "marker": "o" if pop else ".", "ms": 3, "ls": "-" if pop else "--"}
        label = f"{'population' if pop else 'optuna'} seed {r['seed']}"
        axes[0].plot(xs, ys, label=label, **style)
        if ts and all(t is not None for t in ts):
            axes[1].plot(ts, ys, label=label, **style)
    for ax, xlabel in zip(axes[:2], ("member updates (all members / all trials)", "wall time, s")):
        ax.axhline(args.target, color="grey", lw=0.8)
        ax.set(xlabel=xlabel, ylim=(0, 1))
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"best held-out {args.metric} accuracy so far")
    axes[0].legend(fontsize=7, ncol=2)
    lineage_panel(axes[2], args, results)
    fig.suptitle(
        "evolution (members from the prior, truncation) vs Optuna (TPE, median pruner), equal compute"
    )
    fig.tight_layout()
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.plot, dpi=120)
    plt.close(fig)


def lineage_panel(ax: Any, args: argparse.Namespace, results: list[dict[str, Any]]) -> None:
    """Each population slot's learning rate over its updates (a clone's jump: the slot took the
    fittest member's weights and a new value), for the first seed; the search's trials' lrs beside."""
    pops = [r for r in results if r["arm"] == "population"]
    if pops:
        r = pops[0]
        slots: dict[int, list[tuple[int, float]]] = {}
        for x in r["lineage"]:
            slots.setdefault(int(x["slot"]), []).append((int(x["step"]) // args.members, float(x["lr"])))
        for slot, points in sorted(slots.items()):
            ax.step([p[0] for p in points], [p[1] for p in points], where="post", label=f"member slot {slot}")
    for r in (x for x in results if x["arm"] == "optuna" and x["seed"] == (pops[0]["seed"] if pops else 0)):
        ax.scatter(
            [0] * len(r["trials"]),
            [t["lr"] for t in r["trials"]],
            marker="x",
            color="k",
            label="search trials",
        )
    ax.set(
        yscale="log", xlabel="updates of each member", ylabel="learning rate", title="lineage (first seed)"
    )
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)


if __name__ == "__main__":
    main()
