"""Held-out evaluation for rollout algorithms: greedy and sampled episodes on the eval split."""

from __future__ import annotations

from typing import Any, cast

import torch

from rlhf_lightning.algorithms.common import ModuleMixin
from rlhf_lightning.envs.harness import RolloutResult
from rlhf_lightning.rollout.engine import SamplingParams


def episode_success(traj: Any) -> float:
    """Solved when the last turn's info says so (``correct``/``success``/``solved``), else return > 0."""
    last = traj.infos[-1] if traj.infos else {}
    for key in ("correct", "success", "solved"):
        if key in last:
            return float(bool(last[key]))
    return float(sum(traj.rewards) > 0)


class RolloutEvaluation(ModuleMixin):
    """Validation loop: ``eval/accuracy_{greedy,sampled}`` and ``eval/return_{greedy,sampled}``.

    Expects ``self.sampling``, ``self.eval_greedy``, ``self.eval_sampled`` and ``self.rollout``.
    """

    sampling: SamplingParams
    eval_greedy: bool
    eval_sampled: bool
    last_eval_step: int
    _eval_outputs: dict[str, list[torch.Tensor]]

    def rollout(
        self, rows: list[int], params: SamplingParams, *, group_size: int, evaluation: bool = False
    ) -> RolloutResult:
        raise NotImplementedError

    def on_validation_epoch_start(self) -> None:
        self._eval_outputs = {}

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        rows = batch.tolist()
        modes = []
        if self.eval_greedy:
            modes.append(("greedy", SamplingParams(self.sampling.max_new_tokens, temperature=0.0)))
        if self.eval_sampled:
            modes.append(("sampled", self.sampling))
        for name, params in modes:
            result = self.rollout(rows, params, group_size=1, evaluation=True)
            success = torch.tensor([episode_success(t) for t in result.trajectories], dtype=torch.float32)
            self._eval_outputs.setdefault(f"eval/accuracy_{name}", []).append(success)
            self._eval_outputs.setdefault(f"eval/return_{name}", []).append(result.batch.returns.float())

    def on_validation_epoch_end(self) -> None:
        metrics = {}
        for key, chunks in self._eval_outputs.items():
            metrics[key] = cast(torch.Tensor, self.all_gather(torch.cat(chunks))).float().mean().cpu()
        self.log_metrics(metrics)
        for key, short in (("eval/accuracy_greedy", "acc"), ("eval/accuracy_sampled", "acc_sampled")):
            if key in metrics:
                self.log(short, metrics[key], prog_bar=True, logger=False)
        self.last_eval_step = self.global_step
