"""What an algorithm family adds to the learner: a small strategy, not template hooks.

A family says how advantages are estimated from a scored batch, which policy term (and critic
term) the objective has, its parameter groups, how its gradients are clipped, and what state of
its own a member carries (PPO's ``learn_steps`` for the critic warm-up). Every method takes the
member it is about; the learner passes itself for the policy, the ranks and the update plan.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

import torch

from rlhf_lightning.config.algo import RolloutAlgoConfig
from rlhf_lightning.learner.member import Member
from rlhf_lightning.learner.objective import CriticTerm, Objective, PolicyTerm
from rlhf_lightning.learner.plan import UpdatePlan
from rlhf_lightning.learner.records import Advantages, Scored
from rlhf_lightning.learner.stepper import Stepper
from rlhf_lightning.records.trajectory import TrajectoryBatch

Metrics = dict[str, torch.Tensor]


class LearnerView(Protocol):
    """What a family may ask of the learner it serves (:class:`~rlhf_lightning.learner.learner.
    Learner`): the policy, the optimizer stepper, the ranks and a member's update plan."""

    @property
    def policy(self) -> Any: ...

    @property
    def stepper(self) -> Stepper: ...

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def plan(self, member: Member) -> UpdatePlan: ...


class Family:
    """The defaults: no critic, no entropy bonus, one parameter group, one clipping norm."""

    # Whether ``kl_mode=reward`` reaches the advantages per token (``-beta * kl_t`` as each
    # token's reward) rather than summed into the returns (outcome-level advantages only see
    # the sum anyway).
    per_token_kl_reward: ClassVar[bool] = False

    def initial_state(self) -> dict[str, int]:
        """A new member's own counters."""
        return {}

    def advantages(
        self,
        learner: LearnerView,
        member: Member,
        traj: TrajectoryBatch,
        rewards: torch.Tensor,
        returns: torch.Tensor,
        kl_rewards: torch.Tensor | None = None,
    ) -> torch.Tensor | Advantages:
        """Advantages per trajectory (B,) or per token (B, T) from the shaped per-turn rewards
        (B, K) and episode returns (B,) (their sum, plus a KL penalty in ``kl_mode=reward``); a
        tensor, or an :class:`Advantages` record when there is more to pass on (a critic's
        targets, the level the steps were taken at, diagnostics). ``kl_rewards`` (B, T): the
        per-token KL rewards, for a family with ``per_token_kl_reward``."""
        raise NotImplementedError

    def policy_term(self, hp: RolloutAlgoConfig) -> PolicyTerm:
        """The policy-gradient term of the objective, its hyper-parameters bound."""
        raise NotImplementedError

    def critic_term(self, hp: RolloutAlgoConfig) -> CriticTerm | None:
        """A critic trained with the actor (PPO), or None."""
        return None

    def entropy_coef(self, hp: RolloutAlgoConfig) -> float:
        return 0.0

    def objective_for(self, objective: Objective, scored: Scored, hp: RolloutAlgoConfig) -> Objective:
        """The micro-batch loss for this scored batch (PPO picks its ratio level from it)."""
        return objective

    def actor_enabled(self, member: Member) -> bool:
        """False while only a critic trains (PPO's critic warm-up)."""
        return True

    def can_skip_zero_advantage(self, hp: RolloutAlgoConfig) -> bool:
        """Whether rows with zero advantage may be left out of forward/backward (same gradient)."""
        return False

    def normalisers(
        self, learner: LearnerView, norm: dict[str, Any], scored: Scored, rows: torch.Tensor
    ) -> dict[str, Any]:
        """The loss denominators of a mini-batch (``rows``), with the family's own added."""
        return norm

    def clip(self, learner: LearnerView, member: Member, optimizer: Any) -> Metrics:
        """Clip the gradients before the step; returns the norms before clipping."""
        return learner.stepper.clip_all(optimizer, member.hp.grad_clip)

    def param_groups(self, policy: Any, hp: RolloutAlgoConfig) -> list[dict[str, Any]]:
        """The optimizer's parameter groups under ``hp`` (a group may set its own ``lr``)."""
        return [{"params": policy.trainable_parameters()}]

    def learned(self, member: Member) -> None:
        """``member`` finished one training step's update (its counters move on)."""
