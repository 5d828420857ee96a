"""GRPO and its loss variants (CISPO, DAPO, Dr.GRPO, GSPO): one module, the objective is config."""

from __future__ import annotations

import inspect

import torch

from rlhf_lightning.algorithms.base import Metrics, RolloutModule
from rlhf_lightning.envs.trajectory import TrajectoryBatch
from rlhf_lightning.losses import get_advantage_estimator, get_policy_loss


def hparams_for(fn: object, hp: object) -> dict:
    """The fields of ``hp`` named like keyword arguments of ``fn`` (config names = argument names)."""
    params = inspect.signature(fn).parameters  # type: ignore[arg-type]
    return {k: getattr(hp, k) for k, p in params.items() if p.kind is p.KEYWORD_ONLY and hasattr(hp, k)}


class GRPOModule(RolloutModule):
    """Group-relative advantages over ``group_size`` completions per prompt, any registered objective.

    DeepSeekMath (arXiv 2402.03300): for each prompt sample G completions, score them,
    ``A_i = (r_i - mean(r)) / std(r)`` for every token of completion i, then maximise the
    clipped surrogate (``algo.loss``) with an optional KL penalty to the reference (``algo.beta``).
    """

    def setup(self, stage: str) -> None:
        self.loss_fn = get_policy_loss(self.hp.loss)
        self.loss_kwargs = hparams_for(self.loss_fn, self.hp)
        self.advantage_fn = get_advantage_estimator(self.hp.advantage)
        self.advantage_kwargs = {"scale": self.hp.advantage_scale} if self.hp.advantage == "grpo" else {}

    def compute_advantages(self, traj: TrajectoryBatch) -> torch.Tensor:
        return self.advantage_fn(traj.returns.float(), traj.group_ids, **self.advantage_kwargs)

    def policy_loss(
        self, logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, Metrics]:
        return self.loss_fn(logp, old_logp, adv, mask, **self.loss_kwargs)
