"""Pieces every algorithm module shares, online and offline: metric averaging, logging at the
optimizer step, the optimizer step in order (its parts in ``optimizer.py``), and checkpoints
that hold trainable weights only."""

from __future__ import annotations

from typing import Any, ClassVar, cast

import lightning as L
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch.optim.lr_scheduler import LRScheduler

from rlhf_lightning.config.algo import OptimConfig
from rlhf_lightning.learner.optimizer import StepHealth, clip_global_norm, refresh_reference
from rlhf_lightning.learner.plan import lockstep
from rlhf_lightning.learner.records import StepSummary
from rlhf_lightning.models.sharding import is_sharded
from rlhf_lightning.runtime import rng
from rlhf_lightning.runtime.distributed import all_sum, no_backward_sync, reduce_metrics, sync_gradients
from rlhf_lightning.runtime.strategies import split_global
from rlhf_lightning.runtime.workers import close_shared_pools

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


class ModuleMixin(L.LightningModule):
    """Logging at ``step`` = optimizer updates done, one optimizer step, trainable-only checkpoints.

    Args:
        policy: the trainable policy (:class:`~rlhf_lightning.models.policy.Policy`).
        hp: the algorithm's config dataclass; the optimizer step reads ``lr`` and the AdamW
            fields, ``grad_clip`` and ``ref_update_interval``.
    """

    _grad_metrics: Metrics
    # Whether ``training_step`` generates (rollout algorithms): the engine callback wakes the
    # engine before each training batch only then.
    generates_in_training_step: ClassVar[bool] = False
    last_step: StepSummary | None = None  # the last training step's summary (log_step)
    hp: OptimConfig  # the family's schema; each family narrows it (GRPOModule.hp: GRPOConfig)

    def __init__(self, policy: Any, hp: OptimConfig) -> None:
        super().__init__()
        self.automatic_optimization = False
        # Checkpoints hold trainable weights only; the frozen base reloads from model.path.
        self.strict_loading = False
        self.policy, self.hp = policy, hp
        # Steps skipped for a non-finite gradient (checkpointed): one record per optimizer, so
        # each member of a population side by side has its own streak.
        self.healths: list[StepHealth] = [StepHealth()]

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
        """The micro-batches to run with their loss weights (:func:`~.update_plan.lockstep`)."""
        return lockstep(chunks, self.sharded, self.world_size, self.device)

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
        opt, sched = self.current_optimizer(), self.current_scheduler()
        self._grad_metrics = {}
        sync_gradients(self.policy.trainable_parameters(), self.world_size)  # one collective per step
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        self.maybe_update_reference()
        return self._grad_metrics

    def optimizer_index(self) -> int | None:
        """Which of several optimizers steps now (a population's member); None: the only one."""
        return None

    def current_optimizer(self) -> LightningOptimizer:
        opts = self.optimizers()
        i = self.optimizer_index()
        return cast(LightningOptimizer, opts[i] if isinstance(opts, list) and i is not None else opts)

    def current_scheduler(self) -> LRScheduler:
        scheds = self.lr_schedulers()
        i = self.optimizer_index()
        return cast(LRScheduler, scheds[i] if isinstance(scheds, list) and i is not None else scheds)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self._grad_metrics = self.clip_gradients_(optimizer)
        self.skip_if_nonfinite(self._grad_metrics)

    @property
    def health(self) -> StepHealth:
        """The stepping optimizer's record (a population member's own, side by side)."""
        i = self.optimizer_index() or 0
        while len(self.healths) <= i:
            self.healths.append(StepHealth())
        return self.healths[i]

    @property
    def nonfinite_streak(self) -> int:
        """The longest run of skipped steps in a row of any optimizer (the guard stops on it)."""
        return max(h.nonfinite_streak for h in self.healths)

    @property
    def skipped_steps(self) -> int:
        return sum(h.skipped_steps for h in self.healths)

    def skip_if_nonfinite(self, grad_metrics: Metrics) -> None:
        """Drop a step's gradients when a gradient norm is not finite (:class:`StepHealth`)."""
        norms = [v for k, v in grad_metrics.items() if k.endswith("grad_norm")]
        counted = self._trainer is None or str(self.trainer.precision) not in ("16-mixed", "16")
        self.health.skip_if_nonfinite(norms, self.policy.trainable_parameters(), counted)
        grad_metrics["guard/skipped_steps"] = torch.tensor(float(self.skipped_steps))

    def clip_gradients_(self, optimizer: Any) -> Metrics:
        """Clip all trainable gradients by their global norm (``algo.grad_clip``) through Lightning."""
        norm = clip_global_norm(
            self.policy.trainable_parameters(),
            self.hp.grad_clip,
            self.world_size,
            self.sharded,
            lambda v: self.clip_gradients(optimizer, gradient_clip_val=v, gradient_clip_algorithm="norm"),
        )
        return {"actor/grad_norm": norm}

    def maybe_update_reference(self) -> None:
        """The reference refresh every ``algo.ref_update_interval`` optimizer steps."""
        refresh_reference(self.policy, self.hp.ref_update_interval, self.global_step)

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
        checkpoint["guard"] = {**self.healths[0].state_dict(), "each": [h.state_dict() for h in self.healths]}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        guard = checkpoint.get("guard", {})
        self.healths = [StepHealth() for _ in guard.get("each", [guard])]
        for h, state in zip(self.healths, guard.get("each", [guard])):
            h.load_state_dict(state)
        states = checkpoint.get("rng_states")
        if states:
            self._pending_rng = states[self.rank] if self.rank < len(states) else states[0]

    def close(self) -> None:
        """Stop the module's worker processes: the env stepper's and the tool calls' (the run
        calls this at its end, also on failure; a later rollout starts new ones)."""
        harness = getattr(self, "harness", None)
        if harness is not None:
            harness.close()
        close_shared_pools()

    def rng_generators(self) -> dict[str, torch.Generator]:
        """Generators of the module's own that a resume must restore (beside the global ones)."""
        return {}

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """The first step after a resume starts from the RNG states of the checkpoint's step."""
        pending = getattr(self, "_pending_rng", None)
        if pending is not None:
            rng.restore(pending, self.rng_generators())
            self._pending_rng = None
