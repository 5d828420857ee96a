"""GEM games before and after RL: held-out solve rate and valid-move rate, per algorithm and seed.

    .venv/bin/python bench/gem_sudoku.py --algos cispo --seeds 0 1 2              # experiment=gem_sudoku
    .venv/bin/python bench/gem_sudoku.py --experiment gem_guess_number --algos cispo grpo ppo \\
        --plot docs/learning_gem_guess_number.png

Like ``bench/learning.py`` (whose curves and window means it reuses), one training run per
algorithm and seed, each in its own process, one at a time (``--threads`` torch threads), then one
markdown table: solve rate (GEM's "Congratulations!", sampled at the training temperature and
greedy) before the first update and at the end, the valid-move rate on the same eval episodes
(the turns whose move GEM accepted, ``info["valid_move"]`` of ``env=gem``), the run's wall time
turns per episode (mean over the first and the last 10 training steps) and the tokens an episode
costs in the update (``rollout/episode_tokens``, over the run). Each run's row is
also written to its directory (``bench.json``); ``--reuse`` trains nothing and tabulates and plots
the runs earlier commands made (one table and plot over, e.g., 3 CISPO seeds and 1 GRPO seed).

``bench/learning.py`` cannot give the eval valid-move rate: evaluation logs only accuracy and
return. Each run here adds :class:`EvalValidMoves`, a callback that watches the validation
rollouts and logs ``eval/valid_move_{greedy,sampled}`` beside ``eval/accuracy_*``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from a checkout
sys.path.insert(0, str(ROOT / "bench"))

import lightning as L  # noqa: E402
from learning import evals, plot, window_mean  # noqa: E402

from rlhf_lightning.plot import read_metrics  # noqa: E402


def valid_moves(trajs: list[Any]) -> tuple[int, int]:
    """(turns whose move GEM accepted, turns) over ``trajs``."""
    infos = [i for t in trajs for i in t.infos]
    return sum(bool(i.get("valid_move")) for i in infos), len(infos)


class EvalValidMoves(L.Callback):
    """Logs ``eval/valid_move_greedy`` / ``eval/valid_move_sampled``: the share of the validation
    episodes' turns whose move GEM accepted (greedy = temperature 0). It wraps the module's
    harness for the validation epoch only (one process: every eval row is this rank's)."""

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.counts: dict[str, list[int]] = {}
        harness = pl_module.harness
        original = harness.rollout

        def watched(engine: Any, rows: list[int], params: Any, **kwargs: Any) -> Any:
            result = original(engine, rows, params, **kwargs)
            if kwargs.get("evaluation"):
                mode = "greedy" if params.temperature == 0 else "sampled"
                ok, n = valid_moves(result.trajectories)
                c = self.counts.setdefault(mode, [0, 0])
                c[0], c[1] = c[0] + ok, c[1] + n
            return result

        harness.rollout = watched
        self.restore = (harness, original)

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        harness, original = self.restore
        harness.rollout = original
        for mode, (ok, n) in self.counts.items():
            if n:
                pl_module.log(f"eval/valid_move_{mode}", ok / n, logger=True)


def train_one(overrides: list[str]) -> None:
    """One run of ``train.py overrides`` in this process, with :class:`EvalValidMoves`."""
    from hydra import compose, initialize_config_dir

    from rlhf_lightning.config import register_configs
    from rlhf_lightning.run import run

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(config_name="config", overrides=overrides)
    result = run(cfg, extra_callbacks=[EvalValidMoves()])
    if result.exit_code:
        raise SystemExit(result.exit_code)


def pair(metrics: dict, key: str) -> tuple[float, float]:
    """First and last logged value of ``key`` (NaN when never logged)."""
    values = [v for _, v in metrics.get(key, [])]
    return (values[0], values[-1]) if values else (float("nan"), float("nan"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experiment", default="gem_sudoku", help="conf/experiment/<name>.yaml")
    ap.add_argument("--algos", nargs="+", default=["cispo"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--args", nargs="*", default=[], help="extra overrides for every run")
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads of each run (runs go one at a time)"
    )
    ap.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench_gem")
    ap.add_argument(
        "--plot",
        type=Path,
        default=None,
        help="write eval solve-rate curves here, valid-move ones beside (_valid_moves)",
    )
    ap.add_argument(
        "--reuse",
        action="store_true",
        help="train nothing: tabulate and plot the runs already done (bench.json)",
    )
    ap.add_argument("--worker", nargs="*", default=None, help=argparse.SUPPRESS)  # one run, in-process
    a = ap.parse_args()
    if a.worker is not None:
        train_one(a.worker)
        return
    print(
        "| algo | seed | solved sampled before -> after | solved greedy before -> after "
        "| valid moves sampled before -> after | valid moves greedy before -> after | wall s "
        "| turns first / last | tokens / episode | steps |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    curves: dict[str, list[dict[str, float]]] = {}
    valid: dict[str, list[dict[str, float]]] = {}  # eval valid-move rates, as curves
    rows = []
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "TOKENIZERS_PARALLELISM": "false"}
    for algo in a.algos:
        for seed in a.seeds:
            out = a.out / f"{a.experiment}_{algo}_seed{seed}"
            overrides = [
                f"experiment={a.experiment}",
                f"algo={algo}",
                f"seed={seed}",
                f"output_dir={out}",
                "overwrite=true",  # an unfinished earlier run (no bench.json) is replaced
                f"num_threads={a.threads}",
                "trainer.enable_progress_bar=false",
                *a.args,
            ]
            done = out / "bench.json"
            if a.reuse and not done.is_file():
                continue  # not run by an earlier command
            if a.reuse:
                wall = json.loads(done.read_text())["wall_s"]
            else:
                t0 = time.perf_counter()
                proc = subprocess.run(
                    [sys.executable, __file__, "--worker", *overrides],
                    cwd=ROOT,
                    capture_output=True,
                    text=True,
                    env=env,
                )
                wall = time.perf_counter() - t0
                if proc.returncode != 0:
                    print(proc.stderr[-3000:], file=sys.stderr)
                    raise SystemExit(f"{algo} seed {seed} failed")
            metrics = read_metrics(out)
            ev = evals(metrics)
            curves[f"{algo} seed {seed}"] = ev
            valid[f"{algo} seed {seed}"] = [
                {"step": s, "sampled": v, "greedy": g}
                for (s, v), (_, g) in zip(
                    metrics.get("eval/valid_move_sampled", []), metrics.get("eval/valid_move_greedy", [])
                )
            ]
            first, last = ev[0], ev[-1]
            vs, vg = pair(metrics, "eval/valid_move_sampled"), pair(metrics, "eval/valid_move_greedy")
            turns = (
                window_mean(metrics, "rollout/num_turns", n=10, first=True) or 0.0,
                window_mean(metrics, "rollout/num_turns", n=10) or 0.0,
            )
            tokens = (
                window_mean(
                    metrics, "rollout/episode_tokens", n=len(metrics.get("rollout/episode_tokens", []))
                )
                or 0.0
            )
            steps = max(s for s, _ in metrics["rollout/num_turns"])
            row = {
                "algo": algo,
                "seed": seed,
                "solved_sampled": [first["sampled"], last["sampled"]],
                "solved_greedy": [first["greedy"], last["greedy"]],
                "valid_move_sampled": list(vs),
                "valid_move_greedy": list(vg),
                "wall_s": round(wall),
                "turns": list(turns),
                "episode_tokens": round(tokens),
                "steps": steps,
                "threads": a.threads,
            }
            rows.append(row)
            done.write_text(json.dumps(row, indent=1))
            print(
                f"| {algo} | {seed} | {first['sampled']:.3f} -> {last['sampled']:.3f} "
                f"| {first['greedy']:.3f} -> {last['greedy']:.3f} | {vs[0]:.3f} -> {vs[1]:.3f} "
                f"| {vg[0]:.3f} -> {vg[1]:.3f} | {wall:.0f} | {turns[0]:.2f} / {turns[1]:.2f} | {tokens:.0f} | {steps} |",
                flush=True,
            )
    (a.out / f"{a.experiment}_results.json").write_text(json.dumps(rows, indent=1))
    if a.plot is not None:
        plot(curves, a.plot, f"{a.experiment}: held-out solve rate (sampled solid, greedy dashed)")
        moves = a.plot.with_name(f"{a.plot.stem}_valid_moves{a.plot.suffix}")
        title = f"{a.experiment}: held-out valid-move rate (sampled solid, greedy dashed)"
        plot(valid, moves, title, ylabel="held-out valid-move rate")
        print(f"\nplots: {a.plot}, {moves}")


if __name__ == "__main__":
    main()
