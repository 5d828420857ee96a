"""Many multi-process jobs in one launch: ``torchrun --nproc_per_node N tests/torchrun_jobs.py JOBS``
starts N ranks once (the imports, about 7 s a process, paid once) and each rank runs every job
of ``JOBS`` (a JSON list) in order, in the process group torchrun set up (Lightning takes the
ranks torchrun made and keeps the group between fits). A job is ``{"kind": ..., "spec": ...}``:

- ``ddp_worker``: ``tests/algorithms/ddp_worker.py``'s step on fixed data;
- ``eval_worker``: ``tests/algorithms/eval_worker.py``'s recorded evaluation;
- ``run``: ``rlhf_lightning.run.run`` of ``conf/config.yaml`` with ``spec["overrides"]`` and
  ``output_dir=spec["output_dir"]`` (what ``train.py`` would run).

Use :func:`launch` from a test (usually a module-scoped fixture that runs all of its module's
jobs); a job that fails ends the launch, with its traceback in the error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def run_job(job: dict[str, Any]) -> None:
    kind, spec = job["kind"], job["spec"]
    if kind == "ddp_worker":
        from tests.algorithms.ddp_worker import run_spec

        run_spec(spec)
    elif kind == "eval_worker":
        from tests.algorithms.eval_worker import run_spec as run_eval

        run_eval(spec)
    elif kind == "run":
        from rlhf_lightning.run import run
        from tests.conftest import compose_config

        run(compose_config(spec["overrides"], output_dir=Path(spec["output_dir"])))
    else:
        raise ValueError(f"unknown job kind {kind!r}")


def launch(jobs: list[dict[str, Any]], nproc: int, workdir: Path, timeout: float = 900) -> None:
    """Run ``jobs`` on ``nproc`` fresh ranks (one torchrun launch), raising with the output if
    any job fails."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec = workdir / f"jobs_{nproc}.json"
    spec.write_text(json.dumps(jobs))
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [
        str(torchrun),
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        str(ROOT / "tests" / "torchrun_jobs.py"),
        str(spec),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise AssertionError(f"torchrun of {len(jobs)} jobs on {nproc} ranks failed:\n{proc.stderr[-6000:]}")


def main(path: str) -> None:
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("WANDB_MODE", "offline")
    import torch

    torch.set_num_threads(1)
    for job in json.loads(Path(path).read_text()):
        run_job(job)


if __name__ == "__main__":
    main(sys.argv[1])
