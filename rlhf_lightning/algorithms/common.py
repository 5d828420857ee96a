"""Pieces every algorithm module shares: metric averaging, logging at the optimizer step,
the AdamW + warm-up/cosine optimiser, one optimizer-step helper (clip, step, zero, schedule,
reference refresh), and checkpoints that hold trainable weights only."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar, cast

import lightning as L
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch.optim.lr_scheduler import LRScheduler

from rlhf_lightning.algorithms.records import StepSummary
from rlhf_lightning.models.sharding import is_sharded
from rlhf_lightning.runtime import rng
from rlhf_lightning.runtime.distributed import (
    agree_max,
    all_sum,
    clip_by_norm,
    grad_norm,
    no_backward_sync,
    reduce_metrics,
    sync_gradients,
)
from rlhf_lightning.runtime.schedule import warmup_cosine
from rlhf_lightning.strategies import split_global

Metrics = dict[str, torch.Tensor]


class MetricAccumulator:
    """Averages detached metrics over micro-batches (weighted) and updates; ``*_max`` keys keep the max."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.weights: dict[str, torch.Tensor] = {}

    def add(self, metrics: Metrics, weight: torch.Tensor | float = 1.0) -> None:
        for k, v in metrics.items():
            v = v.detach().float()
            if k.endswith("_max"):
                self.sums[k] = torch.maximum(self.sums[k], v) if k in self.sums else v
                self.weights[k] = torch.ones((), device=v.device)
                continue
            w = torch.as_tensor(weight, dtype=torch.float32, device=v.device)
            self.sums[k] = self.sums.get(k, 0) + v * w
            self.weights[k] = self.weights.get(k, 0) + w

    def result(self) -> Metrics:
        return {k: self.sums[k] / self.weights[k].clamp(min=1e-12) for k in self.sums}


def adamw_with_schedule(params: Iterable[Any], hp: Any, total_steps: int) -> dict[str, Any]:
    """AdamW and a per-step warm-up + cosine schedule, from an algorithm config's fields.

    ``params``: parameters, or param-group dicts (a group may set its own ``lr``)."""
    opt = torch.optim.AdamW(
        list(params), lr=hp.lr, weight_decay=hp.weight_decay, betas=tuple(hp.adam_betas), eps=hp.adam_eps
    )
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: warmup_cosine(
            s, warmup_steps=hp.warmup_steps, total_steps=total_steps, min_lr_ratio=hp.min_lr_ratio
        ),
    )
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class ModuleMixin(L.LightningModule):
    """Logging at ``step`` = optimizer updates done, one optimizer step, trainable-only checkpoints.

    Modules set ``policy`` and ``hp`` (with ``grad_clip`` and ``ref_update_interval``).
    """

    policy: Any
    hp: Any
    _grad_metrics: Metrics
    # Whether ``training_step`` generates (rollout algorithms): the engine callback wakes the
    # engine before each training batch only then.
    generates_in_training_step: ClassVar[bool] = False
    last_step: StepSummary | None = None  # the last training step's summary (log_step)

    @property
    def world_size(self) -> int:
        return self.trainer.world_size if self._trainer is not None else 1

    @property
    def rank(self) -> int:
        return self.trainer.global_rank if self._trainer is not None else 0

    @property
    def sharded(self) -> bool:
        """The policy is sharded with FSDP2 (``strategy=fsdp``): every forward is a collective."""
        return is_sharded(self.policy)

    def configure_model(self) -> None:
        """``strategy=fsdp``: shard the policy on Lightning's data-parallel mesh (once)."""
        mesh = getattr(self, "_device_mesh", None)  # set by the ModelParallelStrategy only
        if mesh is not None and not self.sharded:
            self.policy.shard(mesh["data_parallel"])

    def per_rank(self, size: int | None, field: str) -> int | None:
        """A global batch size (``algo.<field>``) split across ranks."""
        return None if size is None else split_global(size, self.world_size, f"algo.{field}")

    def global_count(self, count: torch.Tensor) -> torch.Tensor:
        """A count summed over ranks, per rank: each rank's loss is normalised by it, and the
        gradient average over ranks divides by the world size, so the update is the global one."""
        return all_sum(count, self.world_size) / self.world_size

    def lockstep(self, chunks: list[torch.Tensor]) -> list[tuple[torch.Tensor, float]]:
        """The micro-batches (row indices) to run, each with its loss weight.

        Under FSDP a sharded forward is a collective, so every rank runs as many micro-batches
        as the rank with the most: the others pad with zero-weight passes over their row 0.
        Otherwise ranks run what they have (gradients are averaged once per step).
        """
        out = [(index, 1.0) for index in chunks]
        if not self.sharded:
            return out
        count = agree_max(len(chunks), self.world_size, self.device)
        pad = torch.zeros(1, dtype=torch.long, device=self.device)
        return out + [(pad, 0.0)] * (count - len(chunks))

    def backward_(self, loss: torch.Tensor) -> None:
        """``manual_backward`` without DDP's per-backward all-reduce: gradients accumulate locally
        and :meth:`optimizer_step_` averages them once, so ranks may run different numbers of
        passes (skipped rows, refills) and never wait on each other inside a backward."""
        with no_backward_sync(self.trainer.strategy if self._trainer is not None else None):
            self.manual_backward(loss)

    def optimizer_step_(self) -> Metrics:
        """Clip, step, zero the gradients, advance the schedule, refresh the reference on its
        interval. Returns the gradient norm(s) before clipping.

        Clipping runs in :meth:`on_before_optimizer_step`, which Lightning calls inside
        ``step()`` after mixed precision has unscaled the gradients.
        """
        opt = cast(LightningOptimizer, self.optimizers())
        sched = cast(LRScheduler, self.lr_schedulers())
        self._grad_metrics = {}
        sync_gradients(self.policy.trainable_parameters(), self.world_size)  # one collective per step
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        self.maybe_update_reference()
        return self._grad_metrics

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self._grad_metrics = self.clip_gradients_(optimizer)
        self.skip_if_nonfinite(self._grad_metrics)

    nonfinite_streak = 0  # optimizer steps in a row skipped for a non-finite gradient (the guard reads it)
    skipped_steps = 0

    def skip_if_nonfinite(self, grad_metrics: Metrics) -> None:
        """Drop the gradients of a step whose gradient norm is not finite: AdamW leaves
        parameters without a gradient untouched, so the weights keep their last good values.
        The norms are global, so every rank decides the same. (fp16 loss scaling skips such
        steps itself while it calibrates; they are not counted then.)"""
        norms = [v for k, v in grad_metrics.items() if k.endswith("grad_norm")]
        if not norms or bool(torch.stack([n.float() for n in norms]).isfinite().all()):
            self.nonfinite_streak = 0
        else:
            for p in self.policy.trainable_parameters():
                p.grad = None
            if self._trainer is None or str(self.trainer.precision) not in ("16-mixed", "16"):
                self.nonfinite_streak += 1
                self.skipped_steps += 1
        grad_metrics["guard/skipped_steps"] = torch.tensor(float(self.skipped_steps))

    def clip_gradients_(self, optimizer: Any) -> Metrics:
        """Clip all trainable gradients by their global norm (``algo.grad_clip``) through Lightning."""
        params = self.policy.trainable_parameters()
        norm = grad_norm(params, self.world_size)
        if self.hp.grad_clip is not None and self.sharded:
            clip_by_norm(params, self.hp.grad_clip, norm)  # Lightning's clipping wants one tensor type
        elif self.hp.grad_clip is not None:
            self.clip_gradients(
                optimizer, gradient_clip_val=self.hp.grad_clip, gradient_clip_algorithm="norm"
            )
        return {"actor/grad_norm": norm}

    def maybe_update_reference(self) -> None:
        """Copy the actor onto the reference adapter every ``algo.ref_update_interval`` optimizer
        steps (validation makes sure there is a separate reference adapter to copy onto)."""
        interval = self.hp.ref_update_interval
        if interval and self.global_step % interval == 0:
            self.policy.copy_actor_to_reference()

    def log_metrics(self, metrics: Metrics) -> dict[str, float]:
        """Send metrics, averaged over ranks, to every logger at ``step`` = optimizer updates done
        so far (0 before training), and keep them in ``trainer.callback_metrics``. Returns the
        global values (empty outside a trainer)."""
        if self._trainer is None:
            return {}
        values = reduce_metrics({k: float(v) for k, v in metrics.items()}, self.world_size)  # global
        for logger in self.loggers:
            logger.log_metrics(values, step=self.global_step)
        self.trainer.callback_metrics.update({k: torch.tensor(v) for k, v in values.items()})
        return values

    def log_step(self, metrics: Metrics) -> None:
        """:meth:`log_metrics` for a training step's own metrics, kept as :attr:`last_step`."""
        self.last_step = StepSummary.from_metrics(self.log_metrics(metrics))

    def checkpoint_keys(self) -> set[str]:
        """The parameters a checkpoint holds: trainable ones and a reference adapter (which may
        move), by the roles the policy was built with."""
        roles = self.policy.roles
        kept = roles["actor"] | roles["critic"] | roles["reference"]
        return {f"policy.{n}" for n in kept}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Keep trainable weights (and a reference adapter, which may move) only: the frozen base
        is reloaded from its path on resume. Every rank's RNG states go in too (exact resume)."""
        keep = self.checkpoint_keys()
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in keep}
        checkpoint["trainable_only"] = True
        checkpoint["rng_states"] = rng.gather(rng.capture(self.rng_generators()), self.world_size)
        checkpoint["guard"] = {"nonfinite_streak": self.nonfinite_streak, "skipped_steps": self.skipped_steps}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        guard = checkpoint.get("guard", {})
        self.nonfinite_streak = guard.get("nonfinite_streak", 0)
        self.skipped_steps = guard.get("skipped_steps", 0)
        states = checkpoint.get("rng_states")
        if states:
            self._pending_rng = states[self.rank] if self.rank < len(states) else states[0]

    def rng_generators(self) -> dict[str, torch.Generator]:
        """Generators of the module's own that a resume must restore (beside the global ones)."""
        return {}

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """The first step after a resume starts from the RNG states of the checkpoint's step."""
        pending = getattr(self, "_pending_rng", None)
        if pending is not None:
            rng.restore(pending, self.rng_generators())
            self._pending_rng = None
