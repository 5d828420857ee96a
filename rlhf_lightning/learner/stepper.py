"""Manual optimization on a LightningModule, for every family (online and offline).

    backward (no DDP all-reduce per pass) ... -> step: sync gradients once -> clip (inside
    ``optimizer.step()``, where Lightning calls the module's ``on_before_optimizer_step``) ->
    skip a non-finite step -> step -> zero -> schedule

The parts are the plain functions of ``optimizer.py``; the order is written here, once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch.optim.lr_scheduler import LRScheduler

from rlhf_lightning.learner.optimizer import StepHealth, clip_global_norm, refresh_reference
from rlhf_lightning.learner.plan import lockstep
from rlhf_lightning.models.sharding import is_sharded
from rlhf_lightning.runtime.distributed import all_sum, no_backward_sync, sync_gradients

Metrics = dict[str, torch.Tensor]
# (the optimizer Lightning steps) -> gradient norms before clipping, by metric name
ClipFn = Callable[[Any], Metrics]


class Stepper:
    """Backward passes and optimizer steps of ``host`` (a LightningModule with manual
    optimization) over ``host.policy``'s trainable parameters.

    Args:
        host: the module; the stepper calls only Lightning's own methods on it
            (``manual_backward``, ``optimizers``, ``lr_schedulers``, ``clip_gradients``).
        skipped_total: all steps skipped so far, over every optimizer (``guard/skipped_steps``).
    """

    def __init__(self, host: Any, skipped_total: Callable[[], int]) -> None:
        self.host = host
        self.skipped_total = skipped_total
        self._stepping: tuple[ClipFn, StepHealth] | None = None
        self._grad_metrics: Metrics = {}

    # ---------------------------------------------------------------- where it runs
    @property
    def trainer(self) -> Any:
        return self.host._trainer

    @property
    def world_size(self) -> int:
        return self.trainer.world_size if self.trainer is not None else 1

    @property
    def rank(self) -> int:
        return self.trainer.global_rank if self.trainer is not None else 0

    @property
    def device(self) -> torch.device:
        return cast(torch.device, self.host.device)

    @property
    def sharded(self) -> bool:
        """The policy is sharded with FSDP2 (``strategy=fsdp``): every forward is a collective."""
        return is_sharded(self.host.policy)

    # ---------------------------------------------------------------- passes
    def global_count(self, count: torch.Tensor) -> torch.Tensor:
        """A count summed over ranks, per rank: each rank's loss is normalised by it, and the
        gradient average over ranks divides by the world size, so the update is the global one."""
        return all_sum(count, self.world_size) / self.world_size

    def lockstep(self, chunks: list[torch.Tensor]) -> list[tuple[torch.Tensor, float]]:
        """The micro-batches to run with their loss weights (:func:`~.plan.lockstep`)."""
        return lockstep(chunks, self.sharded, self.world_size, self.device)

    def backward(self, loss: torch.Tensor) -> None:
        """``manual_backward`` without DDP's per-backward all-reduce: gradients accumulate locally
        and :meth:`step` averages them once, so ranks may run different numbers of passes
        (skipped rows, refills) and never wait on each other inside a backward."""
        with no_backward_sync(self.trainer.strategy if self.trainer is not None else None):
            self.host.manual_backward(loss)

    # ---------------------------------------------------------------- optimizer steps
    def optimizer(self, index: int | None = None) -> LightningOptimizer:
        opts = self.host.optimizers()
        return cast(LightningOptimizer, opts[index] if isinstance(opts, list) and index is not None else opts)

    def scheduler(self, index: int | None = None) -> LRScheduler:
        scheds = self.host.lr_schedulers()
        return cast(LRScheduler, scheds[index] if isinstance(scheds, list) and index is not None else scheds)

    def step(self, index: int | None, health: StepHealth, clip: ClipFn) -> Metrics:
        """Optimizer ``index``'s step: sync, ``clip`` (through :meth:`before_step`), skip a
        non-finite step (``health`` counts it), step, zero, advance the schedule. Returns the
        gradient norms before clipping and ``guard/skipped_steps``."""
        opt, sched = self.optimizer(index), self.scheduler(index)
        self._stepping, self._grad_metrics = (clip, health), {}
        sync_gradients(self.host.policy.trainable_parameters(), self.world_size)  # one collective
        try:
            opt.step()
        finally:
            self._stepping = None
        opt.zero_grad(set_to_none=True)
        sched.step()
        return self._grad_metrics

    def before_step(self, optimizer: Any) -> None:
        """The module's ``on_before_optimizer_step``: Lightning calls it inside ``step()``, after
        mixed precision unscaled the gradients. Outside :meth:`step` (a test's own
        ``optimizer.step()``) the whole policy is clipped by ``algo.grad_clip``."""
        clip, health = self._stepping or (lambda o: self.clip_all(o, self.host.hp.grad_clip), StepHealth())
        metrics = clip(optimizer)
        norms = [v for k, v in metrics.items() if k.endswith("grad_norm")]
        precision = str(self.trainer.precision) if self.trainer is not None else "32"
        counted = precision not in ("16-mixed", "16")  # fp16 loss scaling skips such steps itself
        health.skip_if_nonfinite(norms, self.host.policy.trainable_parameters(), counted)
        metrics["guard/skipped_steps"] = torch.tensor(float(self.skipped_total()))
        self._grad_metrics = metrics

    def refresh_reference(self, interval: int | None, done: int) -> None:
        """After a step: copy the actor onto the reference every ``interval`` of ``done`` steps."""
        refresh_reference(self.host.policy, interval, done)

    def clip_norm(
        self, optimizer: Any, params: list[torch.nn.Parameter], max_norm: float | None
    ) -> torch.Tensor:
        """Clip ``params``' gradients by their global norm through Lightning (which knows the
        precision plugin); returns the norm before clipping."""
        return clip_global_norm(
            params,
            max_norm,
            self.world_size,
            self.sharded,
            lambda v: self.host.clip_gradients(
                optimizer, gradient_clip_val=v, gradient_clip_algorithm="norm"
            ),
        )

    def clip_all(self, optimizer: Any, max_norm: float | None) -> Metrics:
        """All trainable gradients by one global norm (``algo.grad_clip``)."""
        params = self.host.policy.trainable_parameters()
        return {"actor/grad_norm": self.clip_norm(optimizer, params, max_norm)}
