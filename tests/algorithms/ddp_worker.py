"""One training step on fixed data with 1 or N processes, as a job of ``tests/torchrun_jobs.py``
(torchrun starts the ranks; one launch runs many specs). Used by test_distributed.py and
test_strategies.py.

SPEC: {"overrides": [...], "devices": N, "out": path, "trajectories": path or [path per step, cycled]
(online) | null, "steps": 1, "strategy": "ddp" | "fsdp"}. Online: rank r trains on its contiguous share of the saved trajectories' groups.
Offline: rank r takes its share of the first ``algo.batch_size`` training rows. Rank 0 saves
the trainable parameters, the averaged gradients of each optimizer step (before clipping)
the logged metrics of every step and the optimizer's state to ``out``.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def run_spec(spec: dict) -> None:
    import lightning as L
    import torch
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader, Subset

    from rlhf_lightning.records.result import RolloutResult
    from rlhf_lightning.records.trajectory import collate
    from rlhf_lightning.run import build
    from rlhf_lightning.runtime.distributed import is_dtensor
    from rlhf_lightning.runtime.strategies import fsdp2_strategy
    from tests.conftest import compose_config

    world = spec["devices"]
    cfg = compose_config(spec["overrides"], output_dir=Path(spec["out"]).parent / "run")
    L.seed_everything(cfg.seed)
    module, dm = build(cfg, Path(spec["out"]).parent)
    if spec.get("trajectories"):
        paths = spec["trajectories"] if isinstance(spec["trajectories"], list) else [spec["trajectories"]]
        per_step = [torch.load(p, weights_only=False) for p in paths]

        def collect(
            rows, sampling, group_size
        ):  # this rank's contiguous share of the groups of this step's batch
            trajectories = per_step[module.trainer.global_step % len(per_step)]
            groups = sorted({t.group_id for t in trajectories})
            r = module.trainer.global_rank
            share = len(groups) // world
            mine = [t for t in trajectories if t.group_id in groups[r * share : (r + 1) * share]]
            return RolloutResult(collate(mine, module.harness.tokenizer.pad_token_id), mine, {}), {}

        module.source.collect = collect
    elif spec.get("record_rows"):  # which prompt rows each rank trains on (the data module's own split)
        original_collect = module.source.collect

        def recording(rows, sampling, group_size):
            path = Path(f"{spec['record_rows']}.rank{module.trainer.global_rank}.json")
            seen = json.loads(path.read_text()) if path.exists() else []
            path.write_text(json.dumps([*seen, rows]))
            return original_collect(rows, sampling, group_size)

        module.source.collect = recording
    else:
        dm.setup("fit")
        b = cfg.algo.batch_size

        def fixed_rows():
            r = module.trainer.global_rank
            rows = Subset(dm.train_set, range(r * b // world, (r + 1) * b // world))
            return DataLoader(rows, batch_size=b // world, collate_fn=dm.collator)

        dm.train_dataloader = fixed_rows

    def full(t: torch.Tensor) -> torch.Tensor:  # FSDP: every rank gathers, in the same order
        return (t.full_tensor() if is_dtensor(t) else t).detach().clone()

    grads: list[dict[str, torch.Tensor]] = []  # the averaged gradients of each optimizer step
    original = module.stepper.before_step  # the clip and the non-finite check, in optimizer.step()

    def record(optimizer):
        grads.append({n: full(p.grad) for n, p in module.named_parameters() if p.grad is not None})
        return original(optimizer)

    module.stepper.before_step = record
    step_metrics: list[dict[str, float]] = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            step_metrics.append({k: float(v) for k, v in trainer.callback_metrics.items()})

    timeout = timedelta(seconds=120)
    strategy = DDPStrategy(timeout=timeout) if world > 1 else "auto"
    if spec.get("strategy") == "fsdp":
        strategy = fsdp2_strategy(None, timeout)
    trainer = L.Trainer(
        max_steps=spec.get("steps", 1),
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        use_distributed_sampler=bool(spec.get("record_rows")),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[Record()],
    )
    trainer.fit(module, datamodule=dm)
    params = {n: full(p) for n, p in module.named_parameters() if p.requires_grad}
    names = {id(p): n for n, p in module.named_parameters()}
    optimizer = module.optimizers().optimizer
    adam = {  # the optimizer's per-parameter state, by parameter name (no state: never stepped)
        names[id(p)]: {k: full(v) if torch.is_tensor(v) else v for k, v in optimizer.state[p].items()}
        for group in optimizer.param_groups
        for p in group["params"]
        if p in optimizer.state
    }
    if trainer.is_global_zero:
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        out = {
            "params": params,
            "grads": grads,
            "adam": adam,
            "step_metrics": step_metrics,
            "metrics": metrics,
            "world": trainer.world_size,
            "sharded": module.sharded,
        }
        torch.save(out, spec["out"])
