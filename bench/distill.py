"""On-policy distillation against GRPO from the same start, on the default task.

    OMP_NUM_THREADS=1 .venv/bin/python bench/distill.py --out outputs/bench_distill --plot docs/learning_distill.png

1. The teacher: the default run (GRPO on the embedded arithmetic model) trained for
   ``--teacher-steps`` updates, exported as a merged model (``python -m rlhf_lightning.export
   --merge``). Skipped when ``OUT/teacher_model`` exists.
2. Two students from the base model, ``--steps`` updates each, evaluated every ``--every``:
   ``algo=distill`` (the teacher's per-token reverse KL alone) and ``algo=grpo`` (the task reward).
   Same seed, batch (16 prompts x 8), lr and schedule.

Prints the teacher's held-out accuracy, each student's curve (sampled, greedy), and the target's
two numbers: the first evaluation where the distilled student's sampled accuracy is within 0.03
of the teacher's, and the first where GRPO's reaches that same accuracy ("never" within the
budget). One thread per run, the runs one after the other.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from a checkout

from bench.learning import evals, plot  # noqa: E402
from rlhf_lightning.plot import read_metrics  # noqa: E402

COMMON = ["num_threads=1", "seed=0", "overwrite=true", "trainer.enable_progress_bar=false"]


def train(out: Path, *overrides: str) -> float:
    t0 = time.perf_counter()
    cmd = [sys.executable, str(ROOT / "train.py"), *COMMON, f"output_dir={out}", *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"train.py {' '.join(overrides)} failed")
    return time.perf_counter() - t0


def first_step(curve: list[dict[str, float]], at_least: float) -> float | None:
    return next((e["step"] for e in curve if e["sampled"] >= at_least), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench_distill")
    ap.add_argument("--teacher-steps", type=int, default=1800)
    ap.add_argument("--steps", type=int, default=900)
    ap.add_argument("--every", type=int, default=75)
    ap.add_argument("--plot", type=Path, default=None)
    a = ap.parse_args()
    out = a.out.resolve()
    teacher_run, teacher_model = out / "teacher", out / "teacher_model"
    if not (teacher_model / "config.json").exists():
        wall = train(teacher_run, f"trainer.max_steps={a.teacher_steps}", "trainer.val_check_interval=300")
        print(f"teacher trained in {wall:.0f} s", flush=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "rlhf_lightning.export",
                str(teacher_run),
                "--out",
                str(teacher_model),
                "--merge",
            ],
            cwd=ROOT,
            check=True,
        )
    teacher = evals(read_metrics(teacher_run))[-1]
    print(
        f"teacher ({a.teacher_steps} GRPO updates): sampled {teacher['sampled']:.3f}, greedy {teacher['greedy']:.3f}"
    )
    budget = [f"trainer.max_steps={a.steps}", f"trainer.val_check_interval={a.every}"]
    curves, walls = {}, {}
    for name, overrides in (
        ("distill", ["algo=distill", f"algo.teacher.path={teacher_model}"]),
        ("grpo", ["algo=grpo"]),
    ):
        walls[name] = train(out / name, *overrides, *budget)
        curves[name] = evals(read_metrics(out / name))
    print("\n| student | wall s | " + " | ".join(f"step {int(e['step'])}" for e in curves["grpo"]) + " |")
    print("|---|---:|" + "---|" * len(curves["grpo"]))
    for name, curve in curves.items():
        cells = " | ".join(f"{e['sampled']:.3f} / {e['greedy']:.3f}" for e in curve)
        print(f"| {name} (sampled / greedy) | {walls[name]:.0f} | {cells} |")
    goal = teacher["sampled"] - 0.03
    s_distill = first_step(curves["distill"], goal)
    s_grpo = first_step(curves["grpo"], goal)
    shown = {k: "never" if v is None else str(int(v)) for k, v in (("d", s_distill), ("g", s_grpo))}
    print(
        f"\nwithin 0.03 of the teacher (sampled >= {goal:.3f}): distill at step {shown['d']}, GRPO at {shown['g']}"
    )
    if a.plot is not None:
        plot(
            {f"{k} (student)": v for k, v in curves.items()},
            a.plot,
            "On-policy distillation vs GRPO, same start",
        )
        print(f"plot: {a.plot}")


if __name__ == "__main__":
    main()
