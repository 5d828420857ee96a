"""Evolution against a search at equal compute, judged by the best held-out accuracy at the end,
with the member updates to a target accuracy beside it.

    .venv/bin/python bench/population.py --seeds 0 1 2 --parallel 1 --plot docs/population_final_best.png   # ~1.5 h on 2 cores

Three arms on the default arithmetic task (tiny model, GRPO, 16 prompts x 8 per step), over the
same space: ``lr`` log-uniform in [1e-5, 1e-2], the training ``temperature`` uniform in
[``--temp-low``, ``--temp-high``] and the cosine schedule's end ``min_lr_ratio`` (the share of lr
it decays to) uniform in [``--decay-low``, 1]: the best learning rate falls as training goes on
(the tuned default decays 1e-3 to 1e-4), so a search, which fixes one value per trial, can only
follow it through the schedule's decay, and a population can mutate both as it trains. All arms
draw their starts from that prior; none gets a hand-picked value.

- **population**: one run of ``--members`` LoRA members side by side (one rollout for all, an
  update of each per population step), each member's start drawn from the prior
  (``population.init=sample``); every ``--evolve-every`` population steps every member is scored
  on the first ``--eval-rows`` held-out problems at temperature 1 (``population.fitness``), the
  least fit quarter replaced by clones of the fittest (``population.selection=truncation``),
  whose lr, temperature or decay is perturbed (x2, x1.2, x1.5) or, one time in four, resampled.
- **mf_pbt**: the same, with ``population.schedule=mf_pbt``: the members split into
  sub-populations evolving every ``--mf-intervals`` rounds of ``--evolve-every`` steps, with
  migration between them (``rlhf_lightning/population/multi_frequency.py``).
- **optuna**: a seeded TPE search whose trials are full runs of ``--trial-steps`` steps, evaluated
  on the same held-out problems every ``--evolve-every`` steps; the median pruner stops a trial
  whose evaluation is below the median of earlier trials at that step (as a user would run it),
  and the search goes on with new trials until it has spent its budget.

Equal compute: every arm gets ``--trials x --trial-steps`` member updates (optimizer steps of all
members together, or of all trials together, pruned ones as far as they ran), and every arm runs
its whole budget (:func:`accounting`). **Final best**: the population's fittest member at its
last scoring, which is at the end of the budget; the search's best final evaluation among its
complete (unpruned) trials, the model a search hands over (Optuna's ``best_trial``). Both are
chosen and measured on the same ``--eval-rows`` problems, the population's among ``--members``
members, the search's among its complete trials. **Updates to target**: the member updates spent
when an evaluation first reaches ``--target`` (the population: all members' updates at that
scoring; the search: every earlier trial's steps, pruned ones as far as they ran, plus the
hitting trial's). Evaluation episodes are not counted in any arm; wall time (model loading and
evaluation included) is reported beside. Each (arm, seed) runs in its own process,
``--parallel`` at a time with one thread each.
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
POPULATIONS = ("population", "mf_pbt")  # the arms that are one population run


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


def next_trial_steps(budget_updates: int, trial_steps: int, ran: list[int]) -> int:
    """The next search trial's length: ``trial_steps``, or what is left of the budget after the
    trials so far ran (pruned ones as far as they ran); 0 when it is spent."""
    return max(min(trial_steps, budget_updates - sum(ran)), 0)


def accounting(result: dict[str, Any]) -> dict[str, int]:
    """The member updates an arm spent against its budget. A population: its population steps
    x its members (one update of each per step). The search: every trial's steps as far as it
    ran, pruned ones included (``pruned_updates`` of them); ``complete``: trials that ran to
    their end and so count for the final best."""
    if result["arm"] == "optuna":
        trials = result["trials"]
        pruned = [t["ran"] for t in trials if t["pruned"]]
        return {"budget": result["budget"], "spent": sum(t["ran"] for t in trials), "trials": len(trials),
                "complete": len(trials) - len(pruned), "pruned": len(pruned), "pruned_updates": sum(pruned)}  # fmt: skip
    spent = result["population_steps_run"] * result["members"]
    return {
        "budget": result["budget"],
        "spent": spent,
        "trials": 0,
        "complete": 0,
        "pruned": 0,
        "pruned_updates": 0,
    }


def final_best_population(curve: list[tuple[int, float]], budget_updates: int) -> float | None:
    """The fittest member's held-out accuracy at the scoring at the end of the budget (None: the
    run has no scoring there)."""
    return next((best for updates, best in curve if updates == budget_updates), None)


def final_best_search(trials: list[dict[str, Any]]) -> tuple[float | None, int | None]:
    """The best last evaluation of a complete (unpruned) trial, and that trial's index (ties:
    the earlier): the model the search hands over. (None, None) without one."""
    ends = [(t["curve"][-1][1], -i) for i, t in enumerate(trials) if not t["pruned"] and t["curve"]]
    if not ends:
        return None, None
    value, i = max(ends)
    return value, -i


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
    """``population.mutate``: the space every arm draws from (lr log-uniform, temperature and the
    schedule's decay uniform)."""
    return (
        f"{{lr:{{low:{LR_LOW},high:{LR_HIGH},scale:2.0}},"
        f"temperature:{{low:{args.temp_low},high:{args.temp_high},scale:1.2}},"
        f"min_lr_ratio:{{low:{args.decay_low},high:1.0,scale:1.5,prior:uniform}}}}"
    )


def population_arm(args: argparse.Namespace, seed: int, out: Path, schedule: str) -> dict[str, Any]:
    """One population run of the whole budget (``schedule``: ``pbt`` or ``mf_pbt``)."""
    from rlhf_lightning.run import run

    updates, steps = budget(args)
    extra = []
    if schedule == "mf_pbt":
        intervals = ",".join(str(d) for d in args.mf_intervals)
        extra = ["population.schedule=mf_pbt", f"population.mf_pbt.intervals=[{intervals}]"]
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
            *extra,
            f"trainer.max_steps={updates}",  # member updates: `steps` population steps
            f"trainer.val_check_interval={updates + 1}",
        ]
    )
    t0 = time.time()
    clk = clock(t0)
    result = run(cfg, extra_callbacks=[clk])
    curve = [
        (int(r["step"]), float(r["population/fitness_best"]), float(r["population/best_lr"]))
        for r in rows(out / "metrics.csv")
        if r.get("population/fitness_best")
    ]
    to_target = population_steps_to_target([(u, f) for u, f, _ in curve], args.target)
    pop = next(c for c in result.trainer.callbacks if hasattr(c, "lineage") and hasattr(c, "members"))
    best = pop.members[pop.best_slot()]
    return {"arm": "population" if schedule == "pbt" else "mf_pbt", "seed": seed, "steps_to_target": to_target,
            "steps_run": curve[-1][0] if curve else 0, "budget": updates, "population_steps": steps,
            "population_steps_run": pop.steps, "members": args.members,
            "final_best": final_best_population([(u, f) for u, f, _ in curve], updates),
            "final_hparams": dict(best.hparams), "wall_s": time.time() - t0,
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
            if self.trial.should_prune():
                self.pruned = trainer.should_stop = True

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(
        direction="maximize",
        sampler=optuna.samplers.TPESampler(seed=seed),
        pruner=optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=0),
    )
    trials: list[dict[str, Any]] = []
    t0, wall_to_target = time.time(), None
    while steps := next_trial_steps(updates, args.trial_steps, [t["ran"] for t in trials]):
        trial = study.ask()
        lr = trial.suggest_float("lr", LR_LOW, LR_HIGH, log=True)
        temperature = trial.suggest_float("temperature", args.temp_low, args.temp_high)
        decay = trial.suggest_float("min_lr_ratio", args.decay_low, 1.0)
        trial_dir = out / f"trial_{len(trials)}"
        cfg = compose(
            [
                *overrides(args, seed, trial_dir),
                f"algo.lr={lr}",
                f"algo.min_lr_ratio={decay}",
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
        trials.append({"lr": lr, "temperature": temperature, "min_lr_ratio": decay, "curve": curve, "hit": hit,
                       "ran": ran, "pruned": report_cb.pruned, "times": [clk.at.get(s) for s, _ in curve]})  # fmt: skip
        if hit is not None and wall_to_target is None and not any(t["hit"] is not None for t in trials[:-1]):
            wall_to_target = clk.at.get(hit)
        if report_cb.pruned:
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        else:
            study.tell(trial, curve[-1][1] if curve else 0.0)
    final, best_trial = final_best_search(trials)
    return {"arm": "optuna", "seed": seed, "steps_to_target": search_steps_to_target(trials, args.target),
            "budget": updates, "steps_run": sum(t["ran"] for t in trials), "wall_s": time.time() - t0,
            "final_best": final, "best_trial": best_trial, "wall_to_target_s": wall_to_target,
            "trials": trials}  # fmt: skip


def worker(args: argparse.Namespace) -> None:
    out = Path(args.work) / f"{args.arm}_{args.seed}"
    if args.arm == "optuna":
        result = optuna_arm(args, args.seed, out)
    else:
        result = population_arm(args, args.seed, out, "pbt" if args.arm == "population" else "mf_pbt")
    (out.parent / f"{args.arm}_{args.seed}.json").write_text(json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--arms", nargs="+", choices=["population", "mf_pbt", "optuna"],
                    default=["population", "mf_pbt", "optuna"])  # fmt: skip
    ap.add_argument("--target", type=float, default=0.45, help="held-out accuracy (--metric) to reach")
    ap.add_argument("--metric", choices=["greedy", "sampled"], default="sampled", help="target and fitness")
    ap.add_argument("--members", type=int, default=4)
    ap.add_argument(
        "--trials", type=int, default=4, help="the budget: --trials x --trial-steps member updates"
    )
    ap.add_argument("--trial-steps", type=int, default=400, help="a search trial's steps (a member's run)")
    ap.add_argument("--evolve-every", type=int, default=50, help="updates of each member between scorings")
    ap.add_argument("--mf-intervals", type=int, nargs="+", default=[1, 4],
                    help="mf_pbt: each sub-population's interval, in --evolve-every rounds")  # fmt: skip
    ap.add_argument("--temp-low", type=float, default=0.6)
    ap.add_argument("--temp-high", type=float, default=1.4)
    ap.add_argument(
        "--decay-low", type=float, default=0.05, help="min_lr_ratio's lowest value (its highest: 1)"
    )
    ap.add_argument("--eval-rows", type=int, default=200)
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--work", default="outputs/bench_population")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None)
    ap.add_argument(
        "--reuse", action="store_true", help="train nothing: tabulate (and plot) the runs in --work"
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--arm", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    budget(args)  # refuse a budget that does not split before any run starts
    Path(args.work).mkdir(parents=True, exist_ok=True)
    shared = sys.argv[1:]
    jobs = [(arm, seed) for seed in args.seeds for arm in args.arms]
    if args.reuse:  # e.g. the seeds run one command each, then one table and plot over them
        report(args, [dict(json.loads((Path(args.work) / f"{a}_{s}.json").read_text())) for a, s in jobs])
        return

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


def how(r: dict[str, Any]) -> str:
    """A run in a few words: the population's starts, clones, migrants and final best member; the
    search's trials."""
    if r["arm"] != "optuna":
        if not r["curve"]:
            return "no scoring"
        starts = [x for x in r["lineage"] if x["event"] == "init"]
        events = [x["event"] for x in r["lineage"]]
        hp = r["final_hparams"]
        return (
            f"starts lr {', '.join(format(float(x['lr']), '.0e') for x in starts)}; {events.count('clone')} clones, "
            f"{events.count('migrant')} migrants; best at the end lr {hp.get('lr', 0):.1e} T "
            f"{hp.get('temperature', 0):.2f} decay {hp.get('min_lr_ratio', 0):.2f}"
        )
    return "trials: " + ", ".join(
        f"lr {t['lr']:.1e} T {t['temperature']:.2f} d {t.get('min_lr_ratio', 1.0):.2f}"
        + (f" pruned @{t['ran']}" if t["pruned"] else f" end {t['curve'][-1][1]:.3f}" if t["curve"] else "")
        for t in r["trials"]
    )


def report(args: argparse.Namespace, results: list[dict[str, Any]]) -> None:
    updates, steps = budget(args)
    print(
        f"equal compute: {updates} member updates each ({args.members} members x {steps} population steps; "
        f"{args.trials} trials x {args.trial_steps} steps); held-out {args.metric} accuracy on {args.eval_rows} "
        f"problems; target {args.target}"
    )
    print("| arm | seed | final best | member updates to target | updates spent | wall s | how |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        acc = accounting(r)
        final = r.get("final_best")
        steps_to = r["steps_to_target"]
        spent = f"{acc['spent']}" + (
            f" ({acc['trials']} trials, {acc['pruned']} pruned: {acc['pruned_updates']})"
            if r["arm"] == "optuna"
            else ""
        )
        shown_final = f"{final:.3f}" if final is not None else "none"
        shown_to = steps_to if steps_to is not None else "not reached"
        print(
            f"| {r['arm']} | {r['seed']} | {shown_final} | {shown_to} | {spent} | {r['wall_s']:.0f} | {how(r)} |"
        )
    for arm in args.arms:
        got = [r for r in results if r["arm"] == arm]
        finals = [r["final_best"] for r in got if r.get("final_best") is not None]
        done = [r["steps_to_target"] for r in got if r["steps_to_target"] is not None]
        mean = sum(finals) / len(finals) if finals else math.nan
        mean_to = sum(done) / len(done) if done else math.nan
        print(
            f"{arm}: mean final best {mean:.3f}; reached the target in {len(done)}/{len(got)} seeds "
            f"(mean member updates {mean_to:.0f})"
        )
    for arm in (a for a in POPULATIONS if a in args.arms):
        if "optuna" in args.arms:
            wins = final_wins(results, args.seeds, arm)
            print(f"{arm}'s final best at least the search's on {wins} of {len(args.seeds)} seeds")
            print(
                f"{arm} reached the target in fewer member updates than the search on "
                f"{evolution_wins(results, args.seeds, arm)} of {len(args.seeds)} seeds"
            )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
    if args.plot:
        plot(args, results)


def final_wins(results: list[dict[str, Any]], seeds: list[int], arm: str = "population") -> int:
    """Seeds on which ``arm``'s final best is at least the search's (a search with no complete
    trial has none)."""
    by: dict[tuple[str, int], float | None] = {(r["arm"], r["seed"]): r.get("final_best") for r in results}
    wins = 0
    for s in seeds:
        mine, search = by.get((arm, s)), by.get(("optuna", s))
        wins += mine is not None and (search is None or mine >= search)
    return wins


def evolution_wins(results: list[dict[str, Any]], seeds: list[int], arm: str = "population") -> int:
    """Seeds on which ``arm`` reached the target in fewer member updates than the search (or
    reached it and the search did not)."""
    by = {(r["arm"], r["seed"]): r["steps_to_target"] for r in results}
    return sum(
        1
        for s in seeds
        if by.get((arm, s)) is not None
        and (by.get(("optuna", s)) is None or by[(arm, s)] < by[("optuna", s)])
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
    looks = {"population": ("o", "-"), "mf_pbt": ("s", "-."), "optuna": (".", "--")}
    for r in results:
        if r["arm"] in POPULATIONS:
            xs, ys, ts = [c[0] for c in r["curve"]], [c[1] for c in r["curve"]], r.get("times", [])
        else:
            xs, ys, ts = search_curve(r)
        color = f"C{args.seeds.index(r['seed']) if r['seed'] in args.seeds else 0}"
        marker, line = looks[r["arm"]]
        style = {"color": color, "marker": marker, "ms": 3, "ls": line}
        label = f"{r['arm']} seed {r['seed']}"
        axes[0].plot(xs, ys, label=label, **style)
        if ts and all(t is not None for t in ts):
            axes[1].plot(ts, ys, label=label, **style)
    for ax, xlabel in zip(axes[:2], ("member updates (all members / all trials)", "wall time, s")):
        ax.axhline(args.target, color="grey", lw=0.8)
        ax.set(xlabel=xlabel, ylim=(0, 1))
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"held-out {args.metric}: fittest member / search's best so far")
    axes[0].legend(fontsize=7, ncol=2)
    lineage_panel(axes[2], args, results)
    fig.suptitle(
        "PBT and MF-PBT (members from the prior) vs Optuna (TPE, median pruner), equal member updates"
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
