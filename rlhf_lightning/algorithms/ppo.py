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
from rlhf_lightning.learner.objective import CriticTerm, Objective, PolicyObjective, PolicyTerm
from rlhf_lightning.learner.records import Advantages, CriticTargets, Scored
from rlhf_lightning.losses import get_advantage_estimator
from rlhf_lightning.losses.advantages import postprocess_advantages
from rlhf_lightning.rollout.trajectory import TrajectoryBatch
from rlhf_lightning.runtime.distributed import clip_by_norm, gather_rows, grad_norm


class PPOModule(RolloutModule):
    """PPO for language-model episodes (Schulman et al. 2017; per-turn credit as in LLM agents).

    Each generated turn is one action: a turn's state value is the critic's value before its
    first token (``turn_value_reduction=state``), GAE discounts across turns (``gamma``,
    ``gae_lambda``) and each turn's advantage applies to all its tokens. Single-turn episodes
    can use token-level GAE instead (``advantage_granularity``; on multi-turn episodes each
    turn's reward then lands on its last token and GAE runs over the action tokens of all turns). An episode stopped
    before a terminal state (``max_turns``, ``max_model_len``, the env's own truncation)
    bootstraps from the critic's value where it stopped; a reply cut at ``max_new_tokens`` ends
    its episode in a terminal state (no next turn can follow it) unless
    ``bootstrap_cut_replies``. The clipped surrogate's ratio is per
    token, per turn or per trajectory (``importance_sampling_level``). The first
    ``critic_warmup_steps`` training steps update the critic only, on Monte-Carlo returns.
    """

    hp: PPOConfig

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.learn_steps = 0  # training steps taken (the critic warm-up counts them)

    # ---------------------------------------------------------------- advantages
    def granularity(self, traj: TrajectoryBatch) -> str:
        g = self.hp.advantage_granularity
        return ("token" if bool((traj.num_turns <= 1).all()) else "turn") if g == "auto" else g

    @property
    def warming_up(self) -> bool:
        return self.learn_steps < self.hp.critic_warmup_steps

    per_token_kl_reward = True  # kl_mode=reward: -beta * kl_t is each token's (or its turn's) reward

    def compute_advantages(
        self, traj: TrajectoryBatch, rewards: torch.Tensor, returns: torch.Tensor
    ) -> Advantages:
        return self.advantages_with_kl_rewards(traj, rewards, returns, None)

    def advantages_with_kl_rewards(
        self,
        traj: TrajectoryBatch,
        rewards: torch.Tensor,
        returns: torch.Tensor,
        kl_rewards: torch.Tensor | None,
    ) -> Advantages:
        """GAE over the batch's steps (turns or tokens), with the critic's targets for the update."""
        hp = self.hp
        level = self.granularity(traj)
        steps_idx, steps = step_index(traj.action_mask, traj.turn_ids, level)
        old_values, boot = self.values_and_bootstrap(traj)  # (B, T), (B,); no gradient
        old_step_v = reduce_to_steps(old_values, steps_idx, steps, hp.turn_value_reduction)
        step_r = step_rewards(
            rewards, steps_idx, steps, level, extra=returns - rewards.sum(-1), turn_ids=traj.turn_ids
        )
        if kl_rewards is not None:  # each step gets the KL penalty of its own tokens
            step_r = step_r + token_sums_to_steps(kl_rewards, steps_idx, steps)
        step_mask = torch.arange(steps, device=self.device)[None, :] < (steps_idx.max(-1).values + 1)[:, None]
        lam = 1.0 if self.warming_up else hp.gae_lambda
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
            steps_all, offset = gather_rows(adv[step_mask], self.world_size, self.rank)
            white = postprocess_advantages(steps_all, whiten=True)
            adv = adv.masked_scatter(step_mask, white[offset : offset + int(step_mask.sum())])
        # Each action token takes its step's advantage.
        tokens = adv.gather(1, steps_idx.clamp(min=0)) * traj.action_mask
        return Advantages(tokens, critic=targets, level=level, metrics=metrics)

    @torch.no_grad()
    def values_and_bootstrap(self, traj: TrajectoryBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The critic's values at the action tokens (B, L-1) and after each row's last token (B,).

        A token's value is read from the hidden state before it, so the value of the state after
        the last generated token is read at that token's own position: one column past the
        (b, w-1) layout, so each micro-batch gets one padding column for this pass.
        """
        values = torch.zeros(traj.action_mask.shape, device=self.device)
        boot = torch.zeros(len(traj), device=self.device)
        rows = torch.arange(len(traj), device=self.device)
        plan = self.plan
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
            )
            v = self.policy.forward_heads(ext, ("value",))["value"].float()  # (b, w)
            values[index, : w - 1] = v[:, :-1] * sub.action_mask
            boot[index] = v[torch.arange(len(index), device=v.device), last]
        return values, boot

    # ---------------------------------------------------------------- the objective
    def policy_term(self) -> PolicyTerm:
        """Per-token PPO-clip, or GSPO's pooled ratio per turn / trajectory (``importance_sampling_level``)."""
        return PolicyTerm.bind("ppo_clip", self.hp)

    def critic_term(self) -> CriticTerm:
        hp = self.hp
        return CriticTerm(hp.vf_coef, hp.value_clip, hp.turn_value_reduction, not hp.fuse_actor_critic_pass)

    def entropy_coef(self) -> float:
        return self.hp.entropy_coef

    def objective_for(self, scored: Scored) -> Objective:
        """The ratio's level follows the batch's granularity when ``importance_sampling_level=auto``:
        per token (PPO-clip), or pooled per turn / trajectory (GSPO's sequence ratio)."""
        level = self.hp.importance_sampling_level
        if level == "auto":
            level = "turn" if scored.level == "turn" else "token"
        name = "ppo_clip" if level == "token" else "gspo"
        objective = self.current_objective()
        if isinstance(objective, PolicyObjective) and objective.term.name != name:
            return objective.with_term(PolicyTerm.bind(name, self.hp, per_turn=level == "turn"))
        return objective

    def actor_loss_enabled(self) -> bool:
        return not self.warming_up

    def normalisers(self, mask: torch.Tensor, rows: torch.Tensor, scored: Scored) -> dict[str, Any]:
        norm = super().normalisers(mask, rows, scored)
        assert scored.critic is not None  # compute_advantages always returns the targets
        norm["num_steps"] = self.global_count(scored.critic.step_mask[rows].sum().float()).clamp(min=1.0)
        return norm

    def clip_gradients_(self, optimizer: Any) -> Metrics:
        if self.hp.share_grad_clip:
            return super().clip_gradients_(optimizer)
        # Separate norms: each part clipped on its own (gradients are unscaled at this point).
        max_norm = self.hp.grad_clip if self.hp.grad_clip is not None else float("inf")
        out = {}
        for part in ("actor", "critic"):
            params = self.policy.trainable_parameters(part)
            norm = grad_norm(params, self.world_size)
            clip_by_norm(params, max_norm, norm)
            if part == "critic" or self.actor_loss_enabled():  # no actor norm in the critic warm-up
                out[f"{part}/grad_norm"] = norm
        return out

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        super().training_step(batch, batch_idx)
        self.learn_steps += 1

    def param_groups(self, hp: RolloutAlgoConfig) -> list[dict[str, Any]]:
        """The actor, and the critic at ``lr_critic`` (``lr`` when unset; ``hp`` is a member's
        PPOConfig)."""
        lr_critic = cast(PPOConfig, hp).lr_critic
        return [
            {"params": self.policy.trainable_parameters("actor")},
            {"params": self.policy.trainable_parameters("critic"), "lr": lr_critic or hp.lr},
        ]

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["ppo_learn_steps"] = self.learn_steps

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        self.learn_steps = checkpoint.get("ppo_learn_steps", 0)


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
