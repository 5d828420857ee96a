"""GRPO and its loss variants (CISPO, DAPO, Dr.GRPO, GSPO, RLOO, REINFORCE++): one module,
the objective and the estimator are config."""

from __future__ import annotations

import torch

from rlhf_lightning.algorithms.base import RolloutModule
from rlhf_lightning.algorithms.checks import validate_grpo
from rlhf_lightning.algorithms.common import Metrics
from rlhf_lightning.algorithms.spec import AlgorithmSpec, register_algorithm
from rlhf_lightning.config import GRPOConfig
from rlhf_lightning.config.algo import node_params, registered_name
from rlhf_lightning.learner.objective import PolicyTerm
from rlhf_lightning.losses import get_advantage_estimator
from rlhf_lightning.losses.advantages import ADVANTAGE_ESTIMATORS, informative_groups, postprocess_advantages
from rlhf_lightning.rollout.harness import RolloutResult
from rlhf_lightning.rollout.trajectory import TrajectoryBatch, collate
from rlhf_lightning.runtime.distributed import gather_rows

GROUP_ID_STRIDE = 1 << 20  # rank r's group ids are offset by r * stride when gathered


class GRPOModule(RolloutModule):
    """Group-relative advantages over ``group_size`` completions per prompt, any registered objective.

    DeepSeekMath (arXiv 2402.03300): for each prompt sample G completions, score them,
    ``A_i = (r_i - mean(r)) / std(r)`` for every token of completion i, then minimise the
    objective ``algo.loss`` (PPO-clip by default) with an optional KL term (``algo.beta``).
    With ``dynamic_sampling`` (DAPO), groups whose rewards are all equal are dropped and
    replaced by groups of freshly drawn prompts.
    """

    hp: GRPOConfig

    def setup(self, stage: str) -> None:
        name, own = registered_name(self.hp.advantage), node_params(self.hp.advantage)
        self.advantage_fn = get_advantage_estimator(name)
        # The estimator's keyword ``x``: the node's ``advantage.x``, else the flat ``advantage_x``
        # (a built-in one's), else the function's own default.
        names = ADVANTAGE_ESTIMATORS.meta(name).get("params", ())
        self.advantage_kwargs = {
            n: own[n] if n in own else getattr(self.hp, f"advantage_{n}")
            for n in names
            if n in own or hasattr(self.hp, f"advantage_{n}")
        }
        # Refill prompts differ per rank (each rank draws its own).
        self.row_generator = torch.Generator().manual_seed(torch.initial_seed() % 2**31 + 7919 * self.rank)

    def rng_generators(self) -> dict[str, torch.Generator]:
        return {"refill_rows": self.row_generator}

    def compute_advantages(
        self, traj: TrajectoryBatch, rewards: torch.Tensor, returns: torch.Tensor
    ) -> torch.Tensor:
        # Batch-level statistics (advantage_scale=batch, whitening, ReBN) are over every rank's
        # rows: each rank computes the global advantages and keeps its own (groups never span ranks).
        all_returns, offset = gather_rows(returns, self.world_size, self.rank)
        groups, _ = gather_rows(traj.group_ids + self.rank * GROUP_ID_STRIDE, self.world_size, self.rank)
        adv = self.advantage_fn(all_returns, groups, **self.advantage_kwargs)
        adv = postprocess_advantages(adv, whiten=self.hp.whiten_advantages, clip=self.hp.advantage_clip)
        return adv[offset : offset + len(returns)]

    def policy_term(self) -> PolicyTerm:
        return PolicyTerm.bind(self.hp.loss, self.hp, per_turn=self.hp.is_level == "turn")

    def can_skip_zero_advantage(self) -> bool:
        return self.hp.skip_zero_advantage

    # ---------------------------------------------------------------- DAPO dynamic sampling
    def collect(self, rows: list[int]) -> tuple[RolloutResult, Metrics]:
        result, first = self.training_rollout(rows)  # refills below: now, with the current weights
        if not self.hp.dynamic_sampling:
            return result, first
        target = len(rows)
        kept = self.informative(result)
        dropped = len(result.trajectories) // self.hp.group_size - len(kept)
        rounds = 0
        while len(kept) < target and rounds < self.hp.max_resample_rounds and self.num_train_rows:
            extra = torch.randint(
                self.num_train_rows, (target - len(kept),), generator=self.row_generator
            ).tolist()
            more = self.rollout(extra, self.sampling, group_size=self.hp.group_size)
            new = self.informative(more)
            dropped += len(extra) - len(new)
            kept += new
            rounds += 1
        metrics = {
            **first,
            "rollout/dropped_groups": torch.tensor(float(dropped)),
            "rollout/resample_rounds": torch.tensor(float(rounds)),
            "rollout/informative_groups": torch.tensor(float(min(len(kept), target))),
        }
        if not kept:  # nothing to learn from: keep the batch (all advantages are 0)
            return result, metrics
        trajectories = []
        for g, group in enumerate(kept[:target]):
            for t in group:
                t.group_id = g
                trajectories.append(t)
        batch = collate(trajectories, self.harness.tokenizer.pad_token_id)
        return RolloutResult(batch, trajectories, result.metrics), metrics

    def informative(self, result: RolloutResult) -> list[list]:
        """The groups of ``result`` whose rewards are not all equal."""
        keep = informative_groups(result.batch.returns, result.batch.group_ids).tolist()
        groups: dict[int, list] = {}
        for t, k in zip(result.trajectories, keep):
            if k:
                groups.setdefault(t.group_id, []).append(t)
        return list(groups.values())


register_algorithm(
    AlgorithmSpec(
        "grpo",
        GRPOModule,
        GRPOConfig,
        needs_reference=lambda hp: hp.beta > 0,
        validate=validate_grpo,
    )
)
