"""One evaluation before training, then one training step, through ``rlhf_lightning.run`` with
1 or N processes, recording what each rank evaluates: a job of ``tests/torchrun_jobs.py``
(torchrun starts the ranks). Used by test_eval_ranks.py.

SPEC: {"overrides": [...], "out": directory}. The overrides choose the processes
(``strategy=ddp trainer.accelerator=cpu trainer.devices=3``, as many as torchrun started).

Every rank writes ``out/eval.rank<r>.json``: per validation ``{"metrics": {eval/* as this rank
has them}, "batches": [...]}``, per batch ``{"batch": [row or -1 (padding)], "calls": [{"rows",
"temperature", "success"}]}`` (one call per rollout in that batch, ``success`` per episode).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def run_spec(spec: dict) -> None:
    import lightning as L

    from rlhf_lightning.algorithms.evaluation import episode_success
    from rlhf_lightning.run import run
    from tests.conftest import compose_config

    out = Path(spec["out"])
    cfg = compose_config(spec["overrides"], output_dir=out / "run")
    validations: list[dict[str, Any]] = []

    class RecordEvaluation(L.Callback):
        def setup(self, trainer: L.Trainer, pl_module: Any, stage: str) -> None:
            if getattr(pl_module, "_recording", False):
                return
            pl_module._recording = True
            original = pl_module.source.generate

            def recording(rows, params, *, group_size, evaluation=False):
                result = original(rows, params, group_size=group_size, evaluation=evaluation)
                if evaluation and validations and validations[-1]["batches"]:
                    success = [episode_success(t) for t in result.trajectories]
                    call = {"rows": list(rows), "temperature": params.temperature, "success": success}
                    validations[-1]["batches"][-1]["calls"].append(call)
                return result

            pl_module.source.generate = recording

        def on_validation_start(self, trainer, pl_module):
            validations.append({"metrics": {}, "batches": []})

        def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
            validations[-1]["batches"].append({"batch": batch.tolist(), "calls": []})

        def on_validation_end(self, trainer, pl_module):
            metrics = trainer.callback_metrics
            validations[-1]["metrics"] = {k: float(v) for k, v in metrics.items() if k.startswith("eval/")}
            path = out / f"eval.rank{trainer.global_rank}.json"
            path.write_text(json.dumps(validations))

    run(cfg, extra_callbacks=[RecordEvaluation()])
