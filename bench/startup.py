"""How fast a bad command line fails: CPU seconds of ``train.py`` with a typo in a key (Hydra's
composition error) and with a bad value (the start-up validation, after torch is imported).

    .venv/bin/python bench/startup.py            # 5 runs each, the median
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = {
    "bad key (algo.lrr=1)": ["algo.lrr=1"],
    "bad value (algo.lr=-1)": ["algo.lr=-1"],
    "bad loss name (algo.loss=foo)": ["algo.loss=foo"],
    "bad KL mode (algo=ppo algo.kl_mode=bar)": ["algo=ppo", "algo.kl_mode=bar"],
    "a family check after the imports (algo.group_size=1)": ["algo.group_size=1"],
}


def cpu_seconds(args: list[str]) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one ``train.py`` run that must fail."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode == 0:
        raise SystemExit(f"train.py {' '.join(args)} did not fail")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    a = ap.parse_args()
    print("| command line | CPU s (median) | wall s (median) |\n|---|---:|---:|")
    for name, args in CASES.items():
        runs = [cpu_seconds(args) for _ in range(a.runs)]
        cpu, wall = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
        print(f"| `python train.py {' '.join(args)}`: {name} | {cpu:.2f} | {wall:.2f} |", flush=True)


if __name__ == "__main__":
    main()
