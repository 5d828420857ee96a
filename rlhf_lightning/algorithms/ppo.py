"""LLM-PPO: actor and critic as two LoRA adapters on one frozen base, turn-level GAE."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, cast

import torch
import torch.nn.functional as F

from rlhf_lightning.algorithms.base import RolloutModule
from rlhf_lightning.algorithms.checks import validate_ppo
from rlhf_lightning.algorithms.common import Metrics
from rlhf_lightning.algorithms.diagnostics import per_turn_means
from rlhf_lightning.algorithms.spec import AlgorithmSpec, register_algorithm
from rlhf_lightning.config import PPOConfig
from rlhf_lightning.config.algo import RolloutAlgoConfig
from rlhf_lightning.learner.critic import (
    explained_variance,
    reduce_to_steps,
    step_index,
    step_rewards,
    token_sums_to_steps,
)
from rlhf_lightning.learner.family import Family, LearnerView
from rlhf_lightning.learner.member import Member
from rlhf_lightning.learner.objective import CriticTerm, Objective, PolicyObjective, PolicyTerm
from rlhf_lightning.learner.records import Advantages, CriticTargets, Scored
from rlhf_lightning.losses import get_advantage_estimator
from rlhf_lightning.losses.advantages import postprocess_advantages
from rlhf_lightning.records.trajectory import TrajectoryBatch
from rlhf_lightning.runtime.distributed import clip_by_norm, gather_rows, grad_norm

LEGACY_LEARN_STEPS = "ppo_learn_steps"  # the warm-up counter's key in checkpoints before the Learner


def warming_up(member: Member) -> bool:
    """Whether ``member`` is in its critic warm-up (its first ``critic_warmup_steps`` steps)."""
    return member.state["learn_steps"] < cast(PPOConfig, member.hp).critic_warmup_steps


class PPOFamily(Family):
    """PPO for language-model episodes (Schulman et al. 2017; per-turn credit as in LLM agents).

    Each generated turn is one action: a turn's state value is the critic's value before its
    first token (``turn_value_reduction=state``), GAE discounts across turns (``gamma``,
    ``gae_lambda``) and each turn's advantage applies to all its tokens. Single-turn episodes
    can use token-level GAE instead (``advantage_granularity``; on multi-turn episodes each
    turn's reward then lands on its last token and GAE runs over the action tokens of all turns).
    An episode stopped before a terminal state (``max_turns``, ``max_model_len``, the env's own
    truncation) bootstraps from the critic's value where it stopped; a reply cut at
    ``max_new_tokens`` ends its episode in a terminal state (no next turn can follow it) unless
    ``bootstrap_cut_replies``. The clipped surrogate's ratio is per token, per turn or per
    trajectory (``importance_sampling_level``). The first ``critic_warmup_steps`` training steps
    of a member update its critic only, on Monte-Carlo returns (its ``learn_steps`` count them).
    """

    per_token_kl_reward = True  # kl_mode=reward: -beta * kl_t is each token's (or its turn's) reward

    def initial_state(self) -> dict[str, int]:
        return {"learn_steps": 0}  # training steps taken (the critic warm-up counts them)

    def learned(self, member: Member) -> None:
        member.state["learn_steps"] = member.state.get("learn_steps", 0) + 1

    # ---------------------------------------------------------------- advantages
    def advantages(
        self,
        learner: LearnerView,
        member: Member,
        traj: TrajectoryBatch,
        rewards: torch.Tensor,
        returns: torch.Tensor,
        kl_rewards: torch.Tensor | None = None,
    ) -> Advantages:
        """GAE over the batch's steps (turns or tokens), with the critic's targets for the update."""
        hp = cast(PPOConfig, member.hp)
        level = granularity(traj, hp.advantage_granularity)
        steps_idx, steps = step_index(traj.action_mask, traj.turn_ids, level)
        old_values, boot = values_and_bootstrap(learner, member, traj)  # (B, T), (B,); no gradient
        old_step_v = reduce_to_steps(old_values, steps_idx, steps, hp.turn_value_reduction)
        step_r = step_rewards(
            rewards, steps_idx, steps, level, extra=returns - rewards.sum(-1), turn_ids=traj.turn_ids
        )
        if kl_rewards is not None:  # each step gets the KL penalty of its own tokens
            step_r = step_r + token_sums_to_steps(kl_rewards, steps_idx, steps)
        device = traj.action_mask.device
        step_mask = torch.arange(steps, device=device)[None, :] < (steps_idx.max(-1).values + 1)[:, None]
        lam = 1.0 if warming_up(member) else hp.gae_lambda
        # Terminal states are worth 0; so is the state after a cut reply, unless asked otherwise.
        goes_on = traj.truncated & (~traj.cut | hp.bootstrap_cut_replies)
        bootstrap = boot * goes_on.to(boot.dtype)
        adv, step_returns = get_advantage_estimator("gae")(
            step_r, old_step_v, step_mask, gamma=hp.gamma, lam=lam, bootstrap=bootstrap
        )
        targets = CriticTargets(steps_idx, old_step_v, step_returns, step_mask)
        metrics = {
            "critic/explained_variance": explained_variance(old_step_v, step_returns, step_mask),
            "critic/value_mean": old_step_v[step_mask].mean(),
        }
        if level == "turn":  # where credit goes across turns (before whitening)
            metrics.update(per_turn_means(old_step_v, step_mask, "critic/value_turn"))
            metrics.update(per_turn_means(adv, step_mask, "critic/adv_turn"))
        if hp.whiten_advantages:  # over every rank's steps
            steps_all, offset = gather_rows(adv[step_mask], learner.world_size, learner.rank)
            white = postprocess_advantages(steps_all, whiten=True)
            adv = adv.masked_scatter(step_mask, white[offset : offset + int(step_mask.sum())])
        # Each action token takes its step's advantage.
        tokens = adv.gather(1, steps_idx.clamp(min=0)) * traj.action_mask
        return Advantages(tokens, critic=targets, level=level, metrics=metrics)

    # ---------------------------------------------------------------- the objective
    def policy_term(self, hp: RolloutAlgoConfig) -> PolicyTerm:
        """Per-token PPO-clip, or GSPO's pooled ratio per turn / trajectory (``importance_sampling_level``)."""
        return PolicyTerm.bind("ppo_clip", hp)

    def critic_term(self, hp: RolloutAlgoConfig) -> CriticTerm:
        ppo = cast(PPOConfig, hp)
        return CriticTerm(
            ppo.vf_coef, ppo.value_clip, ppo.turn_value_reduction, not ppo.fuse_actor_critic_pass
        )

    def entropy_coef(self, hp: RolloutAlgoConfig) -> float:
        return cast(PPOConfig, hp).entropy_coef

    def objective_for(self, objective: Objective, scored: Scored, hp: RolloutAlgoConfig) -> Objective:
        """The ratio's level follows the batch's granularity when ``importance_sampling_level=auto``:
        per token (PPO-clip), or pooled per turn / trajectory (GSPO's sequence ratio)."""
        level = cast(PPOConfig, hp).importance_sampling_level
        if level == "auto":
            level = "turn" if scored.level == "turn" else "token"
        name = "ppo_clip" if level == "token" else "gspo"
        if isinstance(objective, PolicyObjective) and objective.term.name != name:
            return objective.with_term(PolicyTerm.bind(name, hp, per_turn=level == "turn"))
        return objective

    def actor_enabled(self, member: Member) -> bool:
        return not warming_up(member)

    def normalisers(
        self, learner: LearnerView, norm: dict[str, Any], scored: Scored, rows: torch.Tensor
    ) -> dict[str, Any]:
        assert scored.critic is not None  # advantages always returns the targets
        steps = learner.stepper.global_count(scored.critic.step_mask[rows].sum().float())
        return {**norm, "num_steps": steps.clamp(min=1.0)}

    def clip(self, learner: LearnerView, member: Member, optimizer: Any) -> Metrics:
        hp = cast(PPOConfig, member.hp)
        if hp.share_grad_clip:
            return super().clip(learner, member, optimizer)
        # Separate norms: each part clipped on its own (gradients are unscaled at this point).
        max_norm = hp.grad_clip if hp.grad_clip is not None else float("inf")
        out = {}
        for part in ("actor", "critic"):
            params = learner.policy.trainable_parameters(part)
            norm = grad_norm(params, learner.world_size)
            clip_by_norm(params, max_norm, norm)
            if part == "critic" or self.actor_enabled(member):  # no actor norm in the critic warm-up
                out[f"{part}/grad_norm"] = norm
        return out

    def param_groups(self, policy: Any, hp: RolloutAlgoConfig) -> list[dict[str, Any]]:
        """The actor, and the critic at ``lr_critic`` (``lr`` when unset)."""
        lr_critic = cast(PPOConfig, hp).lr_critic
        return [
            {"params": policy.trainable_parameters("actor")},
            {"params": policy.trainable_parameters("critic"), "lr": lr_critic or hp.lr},
        ]


def granularity(traj: TrajectoryBatch, setting: str) -> str:
    """The steps GAE runs over: ``setting``, or with ``auto`` tokens for single-turn batches."""
    return ("token" if bool((traj.num_turns <= 1).all()) else "turn") if setting == "auto" else setting


@torch.no_grad()
def values_and_bootstrap(
    learner: LearnerView, member: Member, traj: TrajectoryBatch
) -> tuple[torch.Tensor, torch.Tensor]:
    """The critic's values at the action tokens (B, T) and after each row's last token (B,).

    A token's value is read from the hidden state before it, so the value of the state after
    the last generated token is read at that token's own position: one column past the
    (b, w-1) layout, so each micro-batch gets one padding column for this pass.
    """
    device = traj.action_mask.device
    values = torch.zeros(traj.action_mask.shape, device=device)
    boot = torch.zeros(len(traj), device=device)
    rows = torch.arange(len(traj), device=device)
    plan = learner.plan(member)
    for index in plan.micro_chunks(rows, plan.row_lengths(traj), len(traj), extra=1):
        sub = traj.select(index)  # (b, w)
        w = sub.input_ids.shape[1]
        last = sub.attention_mask.sum(-1) - 1  # (b,) each row's last token
        ext = replace(
            sub,
            input_ids=F.pad(sub.input_ids, (0, 1)),
            attention_mask=F.pad(sub.attention_mask, (0, 1)),
            action_mask=F.pad(sub.action_mask, (0, 1), value=False) | F.one_hot(last, w).bool(),
            turn_ids=F.pad(sub.turn_ids, (0, 1), value=-1),
            sampling_logps=F.pad(sub.sampling_logps, (0, 1)),
            position_ids=None if sub.position_ids is None else F.pad(sub.position_ids, (0, 1)),
        )
        v = learner.policy.forward_heads(ext, ("value",))["value"].float()  # (b, w)
        values[index, : w - 1] = v[:, :-1] * sub.action_mask
        boot[index] = v[torch.arange(len(index), device=v.device), last]
    return values, boot


class PPOModule(RolloutModule):
    """LLM-PPO (:class:`PPOFamily`): actor and critic as two LoRA adapters on one frozen base."""

    hp: PPOConfig
    family = PPOFamily

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Also a checkpoint from before the Learner redesign: it has no ``member_states`` and
        kept the critic warm-up counter as ``ppo_learn_steps``, the module's one count of training
        steps, which every member learning then shared (a round-robin resident's own counters
        come from the population's state). Read as the guard reads that era's flat record."""
        super().on_load_checkpoint(checkpoint)
        if "member_states" not in checkpoint and LEGACY_LEARN_STEPS in checkpoint:
            for member in self.schedule.members:
                member.state["learn_steps"] = int(checkpoint[LEGACY_LEARN_STEPS])


register_algorithm(
    AlgorithmSpec(
        "ppo",
        PPOModule,
        PPOConfig,
        needs_reference=lambda hp: hp.beta > 0,
        needs_critic=True,
        validate=validate_ppo,
    )
)
