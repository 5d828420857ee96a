"""Supervised fine-tuning on chat data: loss on assistant tokens only."""

from __future__ import annotations

import torch

from rlhf_lightning.algorithms.checks import validate_offline
from rlhf_lightning.algorithms.common import Metrics
from rlhf_lightning.algorithms.offline import OfflineModule
from rlhf_lightning.algorithms.spec import AlgorithmSpec, register_algorithm
from rlhf_lightning.config import SFTConfig
from rlhf_lightning.records.trajectory import TrajectoryBatch


class SFTModule(OfflineModule):
    """Negative log-likelihood of the assistant tokens (prompt and template tokens carry no
    loss), averaged over every assistant token of the batch: micro-batching never changes the
    update."""

    hp: SFTConfig

    def normaliser(self, batch: TrajectoryBatch) -> torch.Tensor:
        return self.stepper.global_count(batch.action_mask.sum().float()).clamp(min=1.0)

    def unit_loss(
        self, batch: TrajectoryBatch, index: torch.Tensor, norm: torch.Tensor
    ) -> tuple[torch.Tensor, Metrics]:
        sub = batch.select(index)
        logp = self.token_logprobs(sub)  # (b, L-1), 0 outside assistant tokens
        nll = -(logp * sub.action_mask).sum()
        tokens = sub.action_mask.sum().float().clamp(min=1.0)
        return nll / norm, {"train/token_nll": nll.detach() / tokens}

    def eval_outputs(self, batch: TrajectoryBatch) -> dict[str, torch.Tensor]:
        logp = self.token_logprobs(batch)
        return {"eval/loss": -logp[batch.action_mask]}  # per token: the mean is the token-mean NLL


register_algorithm(
    AlgorithmSpec("sft", SFTModule, SFTConfig, data="offline", offline_kind="sft", validate=validate_offline)
)
