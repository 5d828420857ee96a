"""The optimizer side of every module, online and offline: AdamW with a warm-up + cosine
schedule, gradient clipping by the global norm, skipping steps whose gradient is not finite,
and the reference refresh on its interval.

These are plain functions and one small state holder (:class:`StepHealth`); the module's
``optimizer_step_`` calls them in order (sync, clip, skip, step, schedule, refresh), so the
order is written once, in ``common.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from rlhf_lightning.config.algo import OptimConfig
from rlhf_lightning.runtime.distributed import clip_by_norm, grad_norm
from rlhf_lightning.runtime.schedule import warmup_cosine

Metrics = dict[str, torch.Tensor]


def adamw_with_schedule(params: Iterable[Any], hp: OptimConfig, total_steps: int) -> dict[str, Any]:
    """AdamW and a per-step warm-up + cosine schedule, from an algorithm config's fields.

    ``params``: parameters, or param-group dicts (a group may set its own ``lr``)."""
    opt = torch.optim.AdamW(
        list(params),
        lr=hp.lr,
        weight_decay=hp.weight_decay,
        betas=(hp.adam_betas[0], hp.adam_betas[1]),
        eps=hp.adam_eps,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: warmup_cosine(
            s, warmup_steps=hp.warmup_steps, total_steps=total_steps, min_lr_ratio=hp.min_lr_ratio
        ),
    )
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def set_base_lrs(opt: torch.optim.Optimizer, sched: Any, lrs: list[float]) -> None:
    """New peak learning rates, one per param group, for an optimizer under a ``LambdaLR``
    schedule: each group's current lr follows at once, the schedule's position is kept."""
    sched.base_lrs = list(lrs)
    for group, lr, fn in zip(opt.param_groups, lrs, sched.lr_lambdas):
        group["initial_lr"] = lr
        group["lr"] = lr * fn(sched.last_epoch)


def clip_global_norm(
    params: list[torch.nn.Parameter],
    max_norm: float | None,
    world_size: int,
    sharded: bool,
    lightning_clip: Callable[[float], None],
) -> torch.Tensor:
    """Clip ``params``' gradients by their global norm (over ranks) and return the norm before
    clipping. ``lightning_clip(max_norm)`` clips through Lightning (which knows the precision
    plugin); FSDP's sharded gradients are clipped here, as Lightning wants one tensor type."""
    norm = grad_norm(params, world_size)
    if max_norm is not None and sharded:
        clip_by_norm(params, max_norm, norm)
    elif max_norm is not None:
        lightning_clip(max_norm)
    return norm


@dataclass
class StepHealth:
    """Optimizer steps skipped for a non-finite gradient norm: in a row (the guard stops the run
    after ``guard.max_nonfinite_steps``) and in all (logged as ``guard/skipped_steps``)."""

    nonfinite_streak: int = 0
    skipped_steps: int = 0

    def skip_if_nonfinite(
        self, norms: list[torch.Tensor], params: list[torch.nn.Parameter], counted: bool
    ) -> bool:
        """Drop the gradients of a step whose gradient norm is not finite: AdamW leaves
        parameters without a gradient untouched, so the weights keep their last good values.
        The norms are global, so every rank decides the same. ``counted`` is False under fp16
        loss scaling, which skips such steps itself while it calibrates. Returns whether the
        step was skipped."""
        if not norms or bool(torch.stack([n.float() for n in norms]).isfinite().all()):
            self.nonfinite_streak = 0
            return False
        for p in params:
            p.grad = None
        if counted:
            self.nonfinite_streak += 1
            self.skipped_steps += 1
        return True

    def state_dict(self) -> dict[str, int]:
        return {"nonfinite_streak": self.nonfinite_streak, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.nonfinite_streak = state.get("nonfinite_streak", 0)
        self.skipped_steps = state.get("skipped_steps", 0)


def refresh_reference(policy: Any, interval: int | None, step: int) -> None:
    """Copy the actor onto the reference adapter every ``interval`` optimizer steps (validation
    makes sure there is a separate reference adapter to copy onto)."""
    if interval and step % interval == 0:
        policy.copy_actor_to_reference()


def total_optimizer_steps(trainer: Any, steps_per_batch: int) -> int:
    """The schedule's length: ``trainer.max_steps`` when set, else the batches the trainer will
    run times the optimizer steps of each (1 outside a trainer)."""
    if trainer is None:
        return 1
    if trainer.max_steps and trainer.max_steps > 0:
        return trainer.max_steps
    return max(int(trainer.estimated_stepping_batches) * steps_per_batch, 1)
