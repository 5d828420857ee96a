"""The rollout engine's lifecycle around Lightning's loop.

    setup          -> the engine exists (every rank its own), not started yet
    batch start    -> wake, sync weights if the policy changed since the last sync
    rollouts done  -> sleep (before the first training forward), offload nothing else
    validation     -> wake and sync before, sleep after
    teardown (fit) -> shut down (an engine that ``outlives_fit``: at the run's end)

Every transition is idempotent, so the order of other callbacks does not matter.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol, cast

import lightning as L
import torch

from rlhf_lightning.models.sharding import gathered
from rlhf_lightning.rollout.engines.base import RolloutEngine
from rlhf_lightning.rollout.hooks import RolloutHooks

log = logging.getLogger(__name__)


class EngineOwner(Protocol):
    """What this callback reads from the LightningModule it drives."""

    engine: RolloutEngine | None
    policy: Any
    global_step: int
    generates_in_training_step: bool


class RolloutEngineCallback(RolloutHooks, L.Callback):
    """Drives ``pl_module.engine`` (any :class:`~rlhf_lightning.rollout.engines.base.RolloutEngine` with
    ``bind_rank``/``wake``/``sleep``/``ensure_synced``/``shutdown``; the HF engine's are no-ops).

    Args:
        offload_trainer_during_rollout: move the policy to the CPU while the engine is awake
            and back before training (GPU memory for a large KV cache).
    """

    def __init__(self, offload_trainer_during_rollout: bool = False) -> None:
        self.offload = offload_trainer_during_rollout
        self.events: list[str] = []  # the lifecycle, for logs and tests

    # -------------------------------------------------------------- transitions
    def ready(self, pl_module: Any) -> None:
        engine = pl_module.engine
        if self.offload and torch.cuda.is_available():
            pl_module.policy.to("cpu")
            torch.cuda.empty_cache()
        engine.wake()
        with gathered(pl_module.policy):  # FSDP: the full adapter, every rank together
            engine.ensure_synced(pl_module.policy, pl_module.global_step)
        self.events.append("wake")

    def release(self, pl_module: Any) -> None:
        pl_module.engine.sleep()
        if self.offload and torch.cuda.is_available():
            pl_module.policy.to(pl_module.device)
        self.events.append("sleep")

    # -------------------------------------------------------------- hooks
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Tell the engine which rank it serves (processes exist now; the engine starts later)."""
        engine = cast(EngineOwner, pl_module).engine
        if engine is not None:
            engine.bind_rank(trainer.global_rank, trainer.world_size, trainer.local_rank)

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if pl_module.generates_in_training_step:  # rollout algorithms: inside training_step
            self.ready(pl_module)

    def on_rollout_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Called by the module once its rollouts are collected, before any training forward."""
        self.release(pl_module)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.ready(pl_module)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.release(pl_module)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Shut the engine down after the fit, unless it outlives fits (inference servers take
        minutes to start: the run's end shuts them down, after its last evaluation)."""
        engine = cast(EngineOwner, pl_module).engine
        if stage == "fit" and not getattr(engine, "outlives_fit", False):
            self.close(pl_module)

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        self.close(pl_module)

    def close(self, pl_module: Any) -> None:
        if pl_module.engine is not None:
            pl_module.engine.shutdown()
            self.events.append("shutdown")
