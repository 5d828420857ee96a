"""Direct preference optimisation (and IPO) on (prompt, chosen, rejected) pairs."""

from __future__ import annotations

import torch

from rlhf_lightning.algorithms.checks import validate_dpo
from rlhf_lightning.algorithms.common import Metrics
from rlhf_lightning.algorithms.offline import OfflineModule
from rlhf_lightning.algorithms.spec import AlgorithmSpec, register_algorithm
from rlhf_lightning.config import DPOConfig
from rlhf_lightning.losses.preference import preference_loss, sequence_logps
from rlhf_lightning.records.trajectory import TrajectoryBatch


class DPOModule(OfflineModule):
    """Batches hold n chosen rows then their n rejected rows (row i and i + n share a prompt,
    which the policy runs once). The reference is the base with adapters disabled, or its own
    frozen adapter (``use_separate_reference_adapter``, moved every ``ref_update_interval``)."""

    hp: DPOConfig

    def units(self, batch: TrajectoryBatch) -> int:
        return len(batch) // 2

    def normaliser(self, batch: TrajectoryBatch) -> torch.Tensor:
        return self.stepper.global_count(torch.tensor(float(self.units(batch)), device=self.device))

    def pair_rows(self, batch: TrajectoryBatch, index: torch.Tensor) -> torch.Tensor:
        return torch.cat([index, index + self.units(batch)])

    def sequence_logps(self, sub: TrajectoryBatch, reference: bool) -> torch.Tensor:
        """Each response's log-prob (summed; averaged over its tokens for IPO). Shape: (2b,)"""
        logp = self.token_logprobs(sub, reference=reference)
        return sequence_logps(logp, sub.action_mask, average=self.hp.loss_type == "ipo")

    def pair_loss(self, sub: TrajectoryBatch) -> tuple[torch.Tensor, Metrics]:
        b = len(sub) // 2
        policy = self.sequence_logps(sub, reference=False)
        with torch.no_grad():
            ref = self.sequence_logps(sub, reference=True)
        losses, m = preference_loss(
            policy[:b],
            policy[b:],
            ref[:b],
            ref[b:],
            beta=self.hp.beta,
            loss_type=self.hp.loss_type,
            label_smoothing=self.hp.label_smoothing,
        )
        return losses, {f"rewards/{k}": v for k, v in m.items()}

    def unit_loss(
        self, batch: TrajectoryBatch, index: torch.Tensor, norm: torch.Tensor
    ) -> tuple[torch.Tensor, Metrics]:
        losses, metrics = self.pair_loss(batch.select(self.pair_rows(batch, index)))
        return losses.sum() / norm, metrics

    def eval_outputs(self, batch: TrajectoryBatch) -> dict[str, torch.Tensor]:
        losses, _ = self.pair_loss(batch)
        b = len(batch) // 2
        with torch.no_grad():
            policy = self.sequence_logps(batch, reference=False)
            ref = self.sequence_logps(batch, reference=True)
        chosen = self.hp.beta * (policy[:b] - ref[:b])
        rejected = self.hp.beta * (policy[b:] - ref[b:])
        return {
            "eval/loss": losses,
            "eval/rewards_accuracy": (chosen > rejected).float(),
            "eval/rewards_margin": chosen - rejected,
        }


register_algorithm(
    AlgorithmSpec(
        "dpo",
        DPOModule,
        DPOConfig,
        data="offline",
        offline_kind="preference",
        needs_reference=lambda hp: True,
        validate=validate_dpo,
    )
)
