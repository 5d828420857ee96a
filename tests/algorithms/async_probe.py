"""A callback for runs in a subprocess (``+callbacks.probe._target_=tests.algorithms.async_probe.Probe``):
each rank writes what its asynchronous rollouts did to ``<run>/probe-rank<r>.json``: per trained
batch its step, rows, seed, a digest of its generated tokens and its size as a file, and a digest of every version's
published weights."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import lightning as L
import torch
from safetensors.torch import load_file

from rlhf_lightning.rollout.asynchronous.producer import dump


def digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


class Probe(L.Callback):
    def setup(self, trainer: L.Trainer, pl_module: Any, stage: str) -> None:
        if stage != "fit":  # the evaluation before training sets up too
            return
        ar = pl_module.source.driver
        transport = ar.transport
        self.batches: list[dict[str, Any]] = []
        self.versions: dict[int, str] = {}
        self.path = Path(trainer.default_root_dir) / f"probe-rank{trainer.global_rank}.json"
        take, publish = ar.take, transport.publish_weights

        def recorded_take(step, rows):
            produced = take(step, rows)
            tokens = hashlib.sha256(json.dumps([t.token_ids for t in produced.result.trajectories]).encode())
            self.batches.append(
                {
                    "step": step,
                    "rows": list(rows),
                    "seed": produced.seed,
                    "tokens": tokens.hexdigest()[:16],
                    "bytes": len(dump(produced)),  # the batch file's size
                }
            )
            return produced

        def recorded_publish(version, weights):
            publish(version, weights)
            self.versions[version] = digest(load_file(transport.store[version]))

        ar.take, transport.publish_weights = recorded_take, recorded_publish

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.path.write_text(json.dumps({"batches": self.batches, "versions": self.versions}))
