"""Held-out evaluation for rollout algorithms: greedy and sampled episodes on the eval split."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, cast

import torch

from rlhf_lightning.algorithms import rng
from rlhf_lightning.algorithms.common import ModuleMixin
from rlhf_lightning.envs.harness import RolloutResult
from rlhf_lightning.models.sharding import gathered
from rlhf_lightning.rollout.engine import SamplingParams


def episode_success(traj: Any) -> float:
    """Solved when the last turn's info says so (``correct``/``success``/``solved``), else return > 0."""
    last = traj.infos[-1] if traj.infos else {}
    for key in ("correct", "success", "solved"):
        if key in last:
            return float(bool(last[key]))
    return float(sum(traj.rewards) > 0)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021, arXiv 2107.03374, eq. 1):
    ``1 - C(n - c, k) / C(n, k)``."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_ks(n: int) -> list[int]:
    """k = 1, 2, 4, ... up to n, and n itself."""
    ks = [k for k in (2**i for i in range(n.bit_length())) if k <= n]
    return sorted({*ks, n})


class RolloutEvaluation(ModuleMixin):
    """Validation loop: ``eval/accuracy_{greedy,sampled}``, ``eval/return_{greedy,sampled}`` and,
    with ``eval_num_samples`` n > 1 sampled completions per problem, ``eval/pass@k`` for k <= n.

    Expects ``self.sampling``, ``self.eval_greedy``, ``self.eval_sampled``,
    ``self.eval_num_samples`` and ``self.rollout``.
    """

    sampling: SamplingParams
    harness: Any
    engine: Any
    policy: Any
    eval_greedy: bool
    eval_sampled: bool
    eval_num_samples: int = 1
    last_eval_step: int
    _eval_outputs: dict[str, list[torch.Tensor]]
    _rng_before_eval: dict[str, Any] | None = None

    def rollout(
        self, rows: list[int], params: SamplingParams, *, group_size: int, evaluation: bool = False
    ) -> RolloutResult:
        """Episodes for ``rows`` with the current policy: the engine is synced first (a no-op when
        nothing changed), so no rollout ever samples stale weights."""
        if self.harness is None or self.engine is None:
            raise RuntimeError("rollouts need a harness and an engine")
        with gathered(self.policy):  # FSDP: ranks generate independently (free when nested)
            ensure_synced = getattr(self.engine, "ensure_synced", None)
            if ensure_synced is not None:
                ensure_synced(self.policy, self.global_step)
            progress = None if evaluation else getattr(self, "report_phase", None)
            return self.harness.rollout(
                self.engine,
                rows,
                params,
                group_size=group_size,
                evaluation=evaluation,
                progress=progress,
                device=self.device,
            )

    def on_validation_start(self) -> None:
        # Evaluation samples from the global RNGs; put them back afterwards, so training draws
        # the same numbers whether or not (and however often) it evaluates: a resumed run,
        # which skips the evaluation after its checkpoint, then continues exactly.
        self._rng_before_eval = rng.capture()

    def restore_training_rng(self) -> None:
        """At the end of the validation epoch: before any callback saves a checkpoint."""
        state = self._rng_before_eval
        if state is not None:
            rng.restore(state)
            self._rng_before_eval = None

    def on_validation_epoch_start(self) -> None:
        self._eval_outputs = {}

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        rows = batch.tolist()
        modes = []
        if self.eval_greedy:
            modes.append(("greedy", dataclasses.replace(self.sampling, temperature=0.0, n=1)))
        if self.eval_sampled:
            modes.append(("sampled", self.sampling))
        for name, params in modes:
            n = self.eval_num_samples if name == "sampled" else 1
            result = self.rollout(rows, params, group_size=n, evaluation=True)
            success = torch.tensor([episode_success(t) for t in result.trajectories], dtype=torch.float32)
            self._eval_outputs.setdefault(f"eval/accuracy_{name}", []).append(success)
            self._eval_outputs.setdefault(f"eval/return_{name}", []).append(result.batch.returns.float())
            if n > 1:
                correct = success.view(-1, n).sum(-1).long().tolist()  # per problem
                for k in pass_ks(n):
                    values = torch.tensor([pass_at_k(n, c, k) for c in correct], dtype=torch.float32)
                    self._eval_outputs.setdefault(f"eval/pass@{k}", []).append(values)

    def on_validation_epoch_end(self) -> None:
        metrics = {}
        for key, chunks in self._eval_outputs.items():
            metrics[key] = cast(torch.Tensor, self.all_gather(torch.cat(chunks))).float().mean().cpu()
        self.log_metrics(metrics)
        for key, short in (("eval/accuracy_greedy", "acc"), ("eval/accuracy_sampled", "acc_sampled")):
            if key in metrics:
                self.log(short, metrics[key], prog_bar=True, logger=False)
        self.last_eval_step = self.global_step
        self.restore_training_rng()
