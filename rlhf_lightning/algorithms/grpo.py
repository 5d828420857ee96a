"""GRPO and its loss variants (CISPO, DAPO, Dr.GRPO, GSPO, RLOO, REINFORCE++): one module,
the objective and the estimator are config."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from omegaconf import DictConfig

from rlhf_lightning.algorithms.base import RolloutModule
from rlhf_lightning.algorithms.checks import validate_grpo
from rlhf_lightning.algorithms.spec import AlgorithmSpec, register_algorithm
from rlhf_lightning.config import GRPOConfig
from rlhf_lightning.config.algo import RolloutAlgoConfig, node_params, registered_name
from rlhf_lightning.config.errors import check
from rlhf_lightning.learner.family import Family, LearnerView
from rlhf_lightning.learner.member import Member
from rlhf_lightning.learner.objective import PolicyTerm
from rlhf_lightning.learner.records import Advantages
from rlhf_lightning.losses import get_advantage_estimator
from rlhf_lightning.losses.advantages import ADVANTAGE_ESTIMATORS, postprocess_advantages
from rlhf_lightning.losses.step_advantages import (
    SCALES,
    anchor_state_groups,
    shared_anchor_fraction,
    turn_advantages_to_tokens,
    turn_mask,
)
from rlhf_lightning.records.trajectory import TrajectoryBatch
from rlhf_lightning.rollout.source import Refill
from rlhf_lightning.runtime.distributed import gather_rows

GROUP_ID_STRIDE = 1 << 20  # rank r's group ids are offset by r * stride when gathered


def estimator(hp: GRPOConfig) -> tuple[Callable[..., torch.Tensor], dict[str, Any]]:
    """``hp.advantage``'s estimator and its keywords: each ``x`` from the node's ``advantage.x``,
    else the flat ``advantage_x`` (a built-in one's), else the function's own default."""
    name, own = registered_name(hp.advantage), node_params(hp.advantage)
    names = ADVANTAGE_ESTIMATORS.meta(name).get("params", ())
    kwargs = {
        n: own[n] if n in own else getattr(hp, f"advantage_{n}")
        for n in names
        if n in own or hasattr(hp, f"advantage_{n}")
    }
    return get_advantage_estimator(name), kwargs


def reward_terms(traj: TrajectoryBatch, returns: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each term of the training return (B, C) and its weight (C,), for decoupled advantages: the
    reward group's terms (``traj.reward_terms``; else the return is the one term), and last what
    scoring added to the return (DAPO's overlong penalty, a KL in the reward) as a term of weight
    1 (0 where nothing was added, below float noise: a constant term adds nothing). The same
    number of terms on every rank, without a host sync."""
    if traj.reward_terms is None or traj.reward_weights is None or len(traj) == 0:
        return returns[:, None], torch.ones(1, dtype=returns.dtype, device=returns.device)
    terms = traj.reward_terms.to(device=returns.device, dtype=returns.dtype)  # (B, C)
    weights = traj.reward_weights[0].to(device=returns.device, dtype=returns.dtype)  # (C,): every row's
    shaping = returns - (terms * weights).sum(-1)  # (B,)
    shaping = torch.where(shaping.abs() > 1e-5, shaping, torch.zeros_like(shaping))
    return torch.cat([terms, shaping[:, None]], dim=1), torch.cat([weights, weights.new_ones(1)])


class GRPOFamily(Family):
    """Group-relative advantages (any registered estimator) and any registered objective."""

    def advantages(
        self,
        learner: LearnerView,
        member: Member,
        traj: TrajectoryBatch,
        rewards: torch.Tensor,
        returns: torch.Tensor,
        kl_rewards: torch.Tensor | None = None,
    ) -> torch.Tensor | Advantages:
        hp = cast(GRPOConfig, member.hp)
        fn, kwargs = estimator(hp)
        if ADVANTAGE_ESTIMATORS.meta(registered_name(hp.advantage)).get("per_turn"):
            return per_turn_advantages(fn, kwargs, traj, rewards, returns, hp.advantage_clip)
        # Batch-level statistics (advantage_scale=batch, whitening, ReBN) are over every rank's
        # rows: each rank computes the global advantages and keeps its own (groups never span ranks).
        ws, rank = learner.world_size, learner.rank
        all_returns, offset = gather_rows(returns, ws, rank)
        groups, _ = gather_rows(traj.group_ids + rank * GROUP_ID_STRIDE, ws, rank)
        if ADVANTAGE_ESTIMATORS.meta(registered_name(hp.advantage)).get("decoupled"):
            terms, weights = reward_terms(traj, returns)
            kwargs = {**kwargs, "components": gather_rows(terms, ws, rank)[0], "weights": weights}
        adv = fn(all_returns, groups, **kwargs)
        adv = postprocess_advantages(adv, whiten=hp.whiten_advantages, clip=hp.advantage_clip)
        return adv[offset : offset + len(returns)]

    def policy_term(self, hp: RolloutAlgoConfig) -> PolicyTerm:
        grpo = cast(GRPOConfig, hp)
        return PolicyTerm.bind(grpo.loss, grpo, per_turn=grpo.is_level == "turn")

    def can_skip_zero_advantage(self, hp: RolloutAlgoConfig) -> bool:
        return cast(GRPOConfig, hp).skip_zero_advantage


def per_turn_advantages(
    fn: Callable[..., torch.Tensor],
    kwargs: dict[str, Any],
    traj: TrajectoryBatch,
    rewards: torch.Tensor,
    returns: torch.Tensor,
    clip: float | None,
) -> Advantages:
    """A per-turn estimator's (gigpo's) advantages on each turn's tokens (B, T), from the shaped
    per-turn rewards (B, K), the returns (B,) and each turn's state. Episode and anchor-state
    groups never span ranks, so each rank's own rows suffice (no gather)."""
    steps = fn(
        rewards, traj.group_ids, state_ids=traj.state_ids, num_turns=traj.num_turns, returns=returns, **kwargs
    )  # (B, K)
    steps = postprocess_advantages(steps, clip=clip)
    labels = anchor_state_groups(traj.group_ids, traj.state_ids, turn_mask(traj.num_turns, rewards.shape[1]))
    return Advantages(
        turn_advantages_to_tokens(steps, traj.turn_ids),
        metrics={"rollout/anchor_shared_frac": shared_anchor_fraction(labels)},
    )


def validate_grpo_family(a: DictConfig, cfg: DictConfig) -> None:
    """:func:`validate_grpo`, and what a per-turn estimator (gigpo) cannot combine with."""
    validate_grpo(a, cfg)
    name = registered_name(a.advantage)
    if not ADVANTAGE_ESTIMATORS.meta(name).get("per_turn"):
        return
    check(
        a.advantage_scale in SCALES,
        "algo.advantage_scale",
        a.advantage_scale,
        f"one of {', '.join(SCALES)} with algo.advantage={name} (its groups are the episode's and "
        "the anchor state's; there is no batch scale)",
    )
    check(
        not a.whiten_advantages,
        "algo.whiten_advantages",
        a.whiten_advantages,
        f"false with algo.advantage={name} (its advantages are per turn; whitening is per episode)",
    )
    check(
        not a.get("use_liger_loss", False),
        "algo.use_liger_loss",
        a.get("use_liger_loss"),
        f"false with algo.advantage={name} (Liger's fused loss takes one advantage per sequence)",
    )
    own = node_params(a.advantage)
    check(
        0.0 <= float(own.get("gamma", 0.95)) <= 1.0,
        "algo.advantage.gamma",
        own.get("gamma"),
        "in [0, 1] (the discount of the step-level returns)",
    )


class GRPOModule(RolloutModule):
    """Group-relative advantages over ``group_size`` completions per prompt, any registered objective.

    DeepSeekMath (arXiv 2402.03300): for each prompt sample G completions, score them,
    ``A_i = (r_i - mean(r)) / std(r)`` for every token of completion i, then minimise the
    objective ``algo.loss`` (PPO-clip by default) with an optional KL term (``algo.beta``).
    With ``dynamic_sampling`` (DAPO), groups whose rewards are all equal are dropped and
    replaced by groups of freshly drawn prompts.
    """

    hp: GRPOConfig
    family = GRPOFamily

    def setup(self, stage: str) -> None:
        super().setup(stage)
        # Refill prompts differ per rank (each rank draws its own).
        self.row_generator.manual_seed(torch.initial_seed() % 2**31 + 7919 * self.rank)

    def rng_generators(self) -> dict[str, torch.Generator]:
        return {"refill_rows": self.row_generator}

    # ---------------------------------------------------------------- DAPO dynamic sampling
    def refill(self) -> Refill | None:
        """With ``dynamic_sampling``, groups whose rewards are all equal are replaced by groups of
        rows drawn from the train split by this module's generator (checkpointed; seeded per rank
        at setup)."""
        self.row_generator = torch.Generator()
        hp = cast(GRPOConfig, self.hp)
        if not hp.dynamic_sampling:
            return None
        return Refill(hp.max_resample_rounds, self.num_train_rows or 0, self.row_generator)


register_algorithm(
    AlgorithmSpec(
        "grpo",
        GRPOModule,
        GRPOConfig,
        needs_reference=lambda hp: hp.beta > 0,
        validate=validate_grpo_family,
    )
)
