"""The skeleton of offline algorithms (SFT, DPO): a batch of examples, micro-batched, one
optimizer step, losses normalised over the whole batch. Evaluation: the held-out split of the
data file, and optionally the env's eval split (greedy / sampled accuracy, like RL runs)."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from rlhf_lightning.algorithms.common import MetricAccumulator, Metrics
from rlhf_lightning.algorithms.evaluation import RolloutEvaluation
from rlhf_lightning.config.algo import OfflineConfig
from rlhf_lightning.learner.optimizer import adamw_with_schedule
from rlhf_lightning.models.policy import Policy
from rlhf_lightning.records.sampling import SamplingParams
from rlhf_lightning.records.trajectory import TrajectoryBatch
from rlhf_lightning.rollout.engines.base import RolloutEngine
from rlhf_lightning.rollout.episodes.harness import RolloutHarness
from rlhf_lightning.rollout.source import RolloutSource
from rlhf_lightning.runtime.strategies import split_global

log = logging.getLogger(__name__)


class OfflineModule(RolloutEvaluation):
    """Subclasses define :meth:`units` (what a micro-batch is split over), :meth:`normaliser`
    and :meth:`unit_loss`; and :meth:`eval_outputs` for the held-out data split."""

    hp: OfflineConfig

    def __init__(
        self,
        policy: Policy,
        hp: OfflineConfig,
        harness: RolloutHarness | None = None,
        engine: RolloutEngine | None = None,
        sampling: SamplingParams | None = None,
        *,
        eval_greedy: bool = True,
        eval_sampled: bool = True,
        eval_num_samples: int = 1,
    ) -> None:
        super().__init__(policy, hp)
        self.harness, self.engine = harness, engine
        # Held-out episodes (with an env to evaluate on), generated now with the current weights.
        self.source = RolloutSource(
            harness, engine, policy, version=lambda: int(self.global_step), device=lambda: self.device
        )
        self.sampling = sampling or SamplingParams()
        self.eval_greedy, self.eval_sampled, self.eval_num_samples = (
            eval_greedy,
            eval_sampled,
            eval_num_samples,
        )
        self.last_eval_step = -1
        self._eval_outputs = {}

    # ---------------------------------------------------------------- hooks
    def units(self, batch: TrajectoryBatch) -> int:
        return len(batch)

    def normaliser(self, batch: TrajectoryBatch) -> torch.Tensor:
        raise NotImplementedError

    def unit_loss(
        self, batch: TrajectoryBatch, index: torch.Tensor, norm: torch.Tensor
    ) -> tuple[torch.Tensor, Metrics]:
        raise NotImplementedError

    def eval_outputs(self, batch: TrajectoryBatch) -> dict[str, torch.Tensor]:
        """Per-example values on the held-out split; their means are logged."""
        raise NotImplementedError

    # ---------------------------------------------------------------- training
    def training_step(self, batch: TrajectoryBatch, batch_idx: int) -> None:
        t0 = time.perf_counter()
        norm = self.normaliser(batch)
        size = self.hp.micro_batch_size
        micro = split_global(size, self.world_size, "algo.micro_batch_size") if size else self.units(batch)
        acc = MetricAccumulator()
        total = torch.zeros((), device=self.device)
        for index, weight in self.stepper.lockstep(
            list(torch.arange(self.units(batch), device=self.device).split(micro))
        ):
            loss, m = self.unit_loss(batch, index, norm)
            self.stepper.backward(loss * weight)
            if not weight:
                continue  # FSDP padding (see lockstep)
            total = total + loss.detach()
            acc.add(m, weight=float(len(index)))
        clip = lambda optimizer: self.stepper.clip_all(optimizer, self.hp.grad_clip)  # noqa: E731
        grad_metrics = self.stepper.step(None, self._health[0], clip)
        self.stepper.refresh_reference(self.hp.ref_update_interval, self.global_step)
        metrics = acc.result()
        metrics.update(
            {
                "train/loss": total,
                **grad_metrics,
                "actor/lr": torch.tensor(self.lr_schedulers().get_last_lr()[0]),  # type: ignore[union-attr]
            }
        )
        step_s = time.perf_counter() - t0
        metrics["perf/step_s"] = torch.tensor(step_s)
        metrics["perf/tokens_per_s"] = batch.attention_mask.sum().float().cpu() / step_s
        self.log_step({k: v.detach().float().cpu() for k, v in metrics.items()})
        self.log("loss", total, prog_bar=True, logger=False)

    # ---------------------------------------------------------------- evaluation
    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        if dataloader_idx == 1:  # env rows: accuracy as in RL runs
            super().validation_step(batch, batch_idx)
            return
        with torch.no_grad():
            for key, value in self.eval_outputs(batch).items():
                self._eval_outputs.setdefault(key, []).append(value.detach().float().cpu())

    # ---------------------------------------------------------------- optimisation
    def configure_optimizers(self) -> Any:
        trainer = self._trainer
        total = trainer.max_steps if trainer is not None and trainer.max_steps > 0 else None
        if total is None:
            total = int(trainer.estimated_stepping_batches) if trainer is not None else 1
        return adamw_with_schedule(self.policy.trainable_parameters(), self.hp, max(total, 1))

    def token_logprobs(self, sub: TrajectoryBatch, reference: bool = False) -> torch.Tensor:
        return self.policy.forward_heads(sub, ("logp",), chunk_rows=self.hp.chunk_rows, reference=reference)[
            "logp"
        ]
