"""Pieces every algorithm module shares, online and offline: logging at the optimizer step,
manual optimization through a :class:`~rlhf_lightning.learner.stepper.Stepper`, the guard's
records, and checkpoints that hold trainable weights only."""

from __future__ import annotations

from typing import Any, ClassVar

import lightning as L
import torch

from rlhf_lightning.config.algo import OptimConfig
from rlhf_lightning.learner.learner import MetricAccumulator
from rlhf_lightning.learner.optimizer import StepHealth
from rlhf_lightning.learner.records import StepSummary
from rlhf_lightning.learner.stepper import Stepper
from rlhf_lightning.models.sharding import is_sharded
from rlhf_lightning.runtime import rng
from rlhf_lightning.runtime.distributed import reduce_metrics
from rlhf_lightning.runtime.workers import close_shared_pools

__all__ = ["MetricAccumulator", "Metrics", "ModuleMixin"]

Metrics = dict[str, torch.Tensor]


class ModuleMixin(L.LightningModule):
    """Logging at ``step`` = optimizer updates done, one optimizer step, trainable-only checkpoints.

    Args:
        policy: the trainable policy (:class:`~rlhf_lightning.models.policy.Policy`).
        hp: the algorithm's config dataclass; the optimizer step reads ``lr`` and the AdamW
            fields, ``grad_clip`` and ``ref_update_interval``.
    """

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
        self.stepper = Stepper(self, lambda: self.skipped_steps)
        self._health = [StepHealth()]  # steps skipped for a non-finite gradient (checkpointed)

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

    def guard_records(self) -> list[StepHealth]:
        """One record of skipped non-finite steps per optimizer (a population member's own)."""
        return self._health

    @property
    def nonfinite_streak(self) -> int:
        """The longest run of skipped steps in a row of any optimizer (the guard stops on it)."""
        return max(h.nonfinite_streak for h in self.guard_records())

    @property
    def skipped_steps(self) -> int:
        return sum(h.skipped_steps for h in self.guard_records())

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.stepper.before_step(optimizer)  # clip, and skip a non-finite step

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
        records = self.guard_records()
        checkpoint["guard"] = {**records[0].state_dict(), "each": [h.state_dict() for h in records]}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        guard = checkpoint.get("guard", {})
        for h, state in zip(self.guard_records(), guard.get("each", [guard])):
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

    def shutdown(self) -> None:
        """The run's end (also on failure): :meth:`close`, and the env's own servers
        (``RolloutHarness.shutdown``: env=openenv's, when the run started it)."""
        self.close()
        harness = getattr(self, "harness", None)
        if harness is not None:
            harness.shutdown()

    def rng_generators(self) -> dict[str, torch.Generator]:
        """Generators of the module's own that a resume must restore (beside the global ones)."""
        return {}

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """The first step after a resume starts from the RNG states of the checkpoint's step."""
        pending = getattr(self, "_pending_rng", None)
        if pending is not None:
            rng.restore(pending, self.rng_generators())
            self._pending_rng = None
