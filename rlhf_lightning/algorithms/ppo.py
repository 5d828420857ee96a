"""LLM-PPO: actor and critic as two LoRA adapters on one frozen base, turn-level GAE."""

from __future__ import annotations

from typing import Any

import torch

from rlhf_lightning.algorithms.base import RolloutModule
from rlhf_lightning.algorithms.common import Metrics, adamw_with_schedule
from rlhf_lightning.algorithms.critic import explained_variance, reduce_to_steps, step_index, step_rewards
from rlhf_lightning.envs.trajectory import TrajectoryBatch
from rlhf_lightning.losses import get_advantage_estimator, get_policy_loss
from rlhf_lightning.losses.advantages import postprocess_advantages
from rlhf_lightning.losses.value import clipped_value_loss


class PPOModule(RolloutModule):
    """PPO for language-model episodes (Schulman et al. 2017; per-turn credit as in LLM agents).

    Each generated turn is one action: the critic's token values are reduced to one value per
    turn (``turn_value_reduction``), GAE discounts across turns (``gamma``, ``gae_lambda``) and
    each turn's advantage applies to all its tokens. Single-turn episodes can use token-level
    GAE instead (``advantage_granularity``). The clipped surrogate's ratio is per token, per
    turn or per trajectory (``importance_sampling_level``). The first ``critic_warmup_steps``
    training steps update the critic only, on Monte-Carlo returns (lambda = 1).
    """

    learn_steps = 0

    def setup(self, stage: str) -> None:
        self.gae = get_advantage_estimator("gae")

    # ---------------------------------------------------------------- advantages
    def granularity(self, traj: TrajectoryBatch) -> str:
        g = self.hp.advantage_granularity
        return ("token" if bool((traj.num_turns <= 1).all()) else "turn") if g == "auto" else g

    @property
    def warming_up(self) -> bool:
        return self.learn_steps < self.hp.critic_warmup_steps

    def compute_advantages(self, traj: TrajectoryBatch, returns: torch.Tensor) -> torch.Tensor:
        hp = self.hp
        self.levels = self.granularity(traj)
        self.steps_idx, steps = step_index(traj.action_mask, traj.turn_ids, self.levels)
        old_values = self.batched_values(traj)  # (B, T), no gradient
        old_step_v = reduce_to_steps(old_values, self.steps_idx, steps, hp.turn_value_reduction)
        rewards = step_rewards(
            traj.rewards.float(), self.steps_idx, steps, self.levels, extra=returns - traj.returns
        )
        self.step_mask = (
            torch.arange(steps, device=self.device)[None, :] < (self.steps_idx.max(-1).values + 1)[:, None]
        )
        lam = 1.0 if self.warming_up else hp.gae_lambda
        adv, self.step_returns = self.gae(rewards, old_step_v, self.step_mask, gamma=hp.gamma, lam=lam)
        self.old_step_values = old_step_v
        self.rollout_extra = {
            "critic/explained_variance": explained_variance(old_step_v, self.step_returns, self.step_mask),
            "critic/value_mean": old_step_v[self.step_mask].mean(),
        }
        if hp.whiten_advantages:
            valid = adv[self.step_mask]
            adv = adv.masked_scatter(self.step_mask, postprocess_advantages(valid, whiten=True))
        # Each action token takes its step's advantage.
        token_adv = adv.gather(1, self.steps_idx.clamp(min=0)) * traj.action_mask
        return token_adv

    def values_of(self, sub: TrajectoryBatch) -> torch.Tensor:
        """The critic's token values ``(b, T')`` for a (micro-)batch."""
        return self.policy.values(
            sub.input_ids,
            sub.attention_mask,
            sub.action_mask,
            prompt_lens=sub.prompt_lens,
            prefix_ids=sub.prefix_ids,
        )

    @torch.no_grad()
    def batched_values(self, traj: TrajectoryBatch) -> torch.Tensor:
        out = torch.zeros(traj.action_mask.shape, device=self.device)
        micro = self.hp.micro_batch_size or len(traj)
        for index in torch.arange(len(traj), device=self.device).split(micro):
            sub = traj.select(index)
            v = self.values_of(sub)
            out[index, : v.shape[1]] = v
        return out

    def score(self, traj: TrajectoryBatch, old_logp: torch.Tensor | None, ref_logp: torch.Tensor | None):
        adv, mask, metrics = super().score(traj, old_logp, ref_logp)
        metrics.update({k: v.detach().float().cpu() for k, v in self.rollout_extra.items()})
        return adv, mask, metrics

    # ---------------------------------------------------------------- losses
    def policy_loss(self, logp, old_logp, adv, mask, turn_ids):
        level = self.hp.importance_sampling_level
        if level == "auto":
            level = "turn" if self.levels == "turn" else "token"
        if level == "token":
            return get_policy_loss("ppo_clip")(
                logp,
                old_logp,
                adv,
                mask,
                clip_low=self.hp.clip_low,
                clip_high=self.hp.clip_high,
                clip_ratio_c=self.hp.clip_ratio_c,
            )
        return get_policy_loss("gspo")(
            logp,
            old_logp,
            adv,
            mask,
            clip_low=self.hp.clip_low,
            clip_high=self.hp.clip_high,
            is_pooling=self.hp.is_pooling,
            turn_ids=turn_ids if level == "turn" else None,
        )

    def actor_loss_enabled(self) -> bool:
        return not self.warming_up

    def can_skip_zero_advantage(self) -> bool:
        return False  # the critic learns from every row

    def normalisers(self, mask: torch.Tensor, rows: torch.Tensor) -> dict[str, Any]:
        norm = super().normalisers(mask, rows)
        norm["num_steps"] = self.global_count(self.step_mask[rows].sum().float()).clamp(min=1.0)
        return norm

    def extra_loss(
        self, traj: TrajectoryBatch, index: torch.Tensor, norm: dict[str, Any]
    ) -> tuple[torch.Tensor, Metrics]:
        """The clipped value loss of this micro-batch's steps, normalised over the mini-batch's steps."""
        hp = self.hp
        sub = traj.select(index)
        values = self.values_of(sub)
        steps = self.step_returns.shape[1]
        idx = self.steps_idx[index][:, : values.shape[1]]
        step_v = reduce_to_steps(values, idx, steps, hp.turn_value_reduction)
        mask = self.step_mask[index]
        per_step, m = clipped_value_loss(
            step_v, self.old_step_values[index], self.step_returns[index], mask, hp.value_clip
        )
        loss = hp.vf_coef * (per_step * mask).sum() / norm["num_steps"]
        metrics = {
            "critic/value_loss": ((per_step * mask).sum() / mask.sum().clamp(min=1)).detach(),
            "critic/vf_clipfrac": m["vf_clipfrac"],
        }
        if not hp.fuse_actor_critic_pass and self.actor_loss_enabled():
            self.manual_backward(loss)  # a separate pass: the actor's activations are already freed
            return torch.zeros((), device=self.device), metrics
        return loss, metrics

    def clip_gradients_(self) -> Metrics:
        if self.hp.share_grad_clip:
            return super().clip_gradients_()
        max_norm = self.hp.grad_clip if self.hp.grad_clip is not None else float("inf")
        out = {}
        for part in ("actor", "critic"):
            params = [p for p in self.policy.trainable_parameters(part) if p.grad is not None]
            if params:
                out[f"{part}/grad_norm"] = torch.nn.utils.clip_grad_norm_(params, max_norm).detach()
        return out

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        super().training_step(batch, batch_idx)
        self.learn_steps += 1

    def configure_optimizers(self) -> Any:
        groups = [
            {"params": self.policy.trainable_parameters("actor")},
            {"params": self.policy.trainable_parameters("critic"), "lr": self.hp.lr_critic or self.hp.lr},
        ]
        return adamw_with_schedule(groups, self.hp, self.total_optimizer_steps())

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["ppo_learn_steps"] = self.learn_steps

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.learn_steps = checkpoint.get("ppo_learn_steps", 0)
