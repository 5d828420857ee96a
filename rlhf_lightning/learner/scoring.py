"""Scoring one rollout batch: shaped rewards -> advantages -> the tokens that count in the loss.

Every way a reward is shaped before the update lives here once: DAPO's soft overlong penalty,
the KL to the reference outside the loss (``kl_mode=reward``: in the returns, or per token for a
family whose advantages take per-token rewards; ``kl_mode=advantage``: per-token shaping of the
advantages), masking of unfinished episodes, and the off-policy masks. The family contributes
only its advantage estimator.

Notation:
    B: trajectories, K: turns, T: token positions (L-1).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rlhf_lightning.config.algo import RolloutAlgoConfig
from rlhf_lightning.learner.records import Advantages, Metrics, Scored
from rlhf_lightning.learner.teacher import distills_full_kl
from rlhf_lightning.losses import kl
from rlhf_lightning.losses.corrections import offpolicy_mask, overlong_penalty
from rlhf_lightning.losses.kl import kl_penalized_returns, kl_shaped_advantages
from rlhf_lightning.losses.masked import masked_mean
from rlhf_lightning.records.result import RolloutResult
from rlhf_lightning.records.trajectory import TrajectoryBatch, collate
from rlhf_lightning.runtime.distributed import all_sum

# (batch, per-turn rewards (B, K), returns (B,)) -> advantages
AdvantageFn = Callable[[TrajectoryBatch, torch.Tensor, torch.Tensor], "torch.Tensor | Advantages"]
# the same with per-token KL rewards (B, T) on top
AdvantageWithKLFn = Callable[
    [TrajectoryBatch, torch.Tensor, torch.Tensor, torch.Tensor], "torch.Tensor | Advantages"
]


def as_advantages(found: torch.Tensor | Advantages) -> Advantages:
    """An advantage estimator's result as a record (a bare tensor is the advantages alone)."""
    return found if isinstance(found, Advantages) else Advantages(found)


@dataclass(frozen=True)
class Scorer:
    """The scoring settings, as plain values (bound from the algorithm config at the module).

    Args:
        max_new_tokens: the per-turn length cap (the overlong penalty's reference).
        overlong_buffer, overlong_penalty_factor: DAPO's soft overlong penalty (None: off).
        beta, kl_mode, kl_estimator, kl_clamp: the KL to the reference; scored here unless
            ``kl_mode=loss`` (the objective's KL term) or ``beta == 0``.
        per_token_kl_reward: ``kl_mode=reward`` reaches the family's advantages per token.
        mask_truncated: drop unfinished (truncated or cut) episodes from the loss.
        offpolicy_token_bounds, offpolicy_seq_threshold: trainer/engine off-policy masks.
        distill_coef: on-policy distillation's weight (0: off; it needs the teacher's log-probs).
        distill_task_reward: keep the task's advantages beside the distillation term (False:
            pure distillation).
        distill_full: the distillation term is the objective's exact KL, not an advantage (only
            ``distill_task_reward=False`` acts here: the task's advantages are dropped).
    """

    max_new_tokens: int
    overlong_buffer: int | None = None
    overlong_penalty_factor: float = 1.0
    beta: float = 0.0
    kl_mode: str = "loss"
    kl_estimator: str = "k3"
    kl_clamp: float | None = 10.0
    per_token_kl_reward: bool = False
    mask_truncated: bool = False
    offpolicy_token_bounds: tuple[float, float] | None = None
    offpolicy_seq_threshold: float | None = None
    distill_coef: float = 0.0
    distill_task_reward: bool = True
    distill_full: bool = False

    @classmethod
    def from_hp(cls, hp: RolloutAlgoConfig, max_new_tokens: int, per_token_kl_reward: bool) -> Scorer:
        """The scorer of an algorithm config (the module boundary: nothing below sees ``hp``)."""
        bounds = hp.offpolicy_token_bounds
        return cls(
            max_new_tokens=max_new_tokens,
            overlong_buffer=hp.overlong_buffer,
            overlong_penalty_factor=hp.overlong_penalty_factor,
            beta=hp.beta,
            kl_mode=hp.kl_mode,
            kl_estimator=hp.kl_estimator,
            kl_clamp=hp.kl_clamp,
            per_token_kl_reward=per_token_kl_reward,
            mask_truncated=hp.mask_truncated,
            offpolicy_token_bounds=(float(bounds[0]), float(bounds[1])) if bounds is not None else None,
            offpolicy_seq_threshold=hp.offpolicy_seq_threshold,
            distill_coef=float(hp.distill.coef) if hp.teacher.path is not None else 0.0,
            distill_task_reward=bool(hp.distill.task_reward),
            distill_full=distills_full_kl(hp),
        )

    def __call__(
        self,
        traj: TrajectoryBatch,
        old_logp: torch.Tensor | None,
        ref_logp: torch.Tensor | None,
        advantages: AdvantageFn,
        advantages_with_kl: AdvantageWithKLFn,
        teacher_logp: torch.Tensor | None = None,
    ) -> Scored:
        """Score ``traj``: ``old_logp`` (B, T) the trainer's behaviour log-probs (None:
        on-policy), ``ref_logp`` (B, T) the reference's (None without a KL), ``teacher_logp``
        (B, T) the distillation teacher's (None without one)."""
        metrics: Metrics = {}
        rewards = traj.rewards.float()  # (B, K)
        if self.overlong_buffer:
            # Each turn from its own length: the cap is per turn (rollout.max_new_tokens).
            penalty = overlong_penalty(
                traj.turn_lengths, self.max_new_tokens, self.overlong_buffer, self.overlong_penalty_factor
            ) * (traj.turn_lengths > 0)
            rewards = rewards + penalty
            metrics["rollout/overlong_penalty"] = penalty.sum(-1).mean()
        returns = rewards.sum(-1)
        kl_tokens = None
        if ref_logp is not None and self.kl_mode != "loss":
            behaviour = old_logp if old_logp is not None else traj.sampling_logps
            kl_tokens = kl(behaviour, ref_logp, self.kl_estimator, self.kl_clamp) * traj.action_mask
            metrics["actor/kl"] = masked_mean(kl_tokens, traj.action_mask)
        if kl_tokens is not None and self.kl_mode == "reward" and self.per_token_kl_reward:
            kl_rewards = -self.beta * kl_tokens.detach()  # (B, T), each token's own penalty
            found = as_advantages(advantages_with_kl(traj, rewards, returns, kl_rewards))
        else:
            if kl_tokens is not None and self.kl_mode == "reward":
                returns = kl_penalized_returns(returns, kl_tokens, traj.action_mask, self.beta)
            found = as_advantages(advantages(traj, rewards, returns))
        adv = found.tokens
        metrics.update(found.metrics)
        if kl_tokens is not None and self.kl_mode == "advantage":
            adv = kl_shaped_advantages(adv, kl_tokens, traj.action_mask, self.beta)
        if self.distill_full and not self.distill_task_reward:
            adv = torch.zeros_like(adv)  # pure distillation: the objective's KL term alone
        elif teacher_logp is not None and self.distill_coef != 0:
            behaviour = old_logp if old_logp is not None else traj.sampling_logps
            adv, m = distilled_advantages(
                adv, behaviour, teacher_logp, traj.action_mask, self.distill_coef, self.distill_task_reward
            )
            metrics.update(m)
        mask = traj.action_mask
        if self.mask_truncated:  # episodes with no terminal state, or with a reply cut at the length cap
            unfinished = traj.truncated | traj.cut
            mask = mask & ~unfinished[:, None]
            metrics["rollout/masked_truncated_frac"] = unfinished.float().mean()
        if old_logp is not None and (
            self.offpolicy_token_bounds is not None or self.offpolicy_seq_threshold is not None
        ):
            mask, m = offpolicy_mask(
                old_logp,
                traj.sampling_logps,
                mask,
                token_bounds=self.offpolicy_token_bounds,
                seq_threshold=self.offpolicy_seq_threshold,
            )
            metrics.update({f"is/{k}": v for k, v in m.items()})
        metrics["actor/adv_mean"] = adv.float().mean() if adv.dim() == 1 else masked_mean(adv, mask)
        out = {k: v.detach().float().cpu() for k, v in metrics.items()}
        return Scored(adv, mask, out, critic=found.critic, level=found.level)


def distilled_advantages(
    advantages: torch.Tensor,
    student_logp: torch.Tensor,
    teacher_logp: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
    task_reward: bool = True,
) -> tuple[torch.Tensor, Metrics]:
    """On-policy distillation's per-token advantage: the sampled-token estimate of the reverse
    KL to the teacher, ``k_t = log pi_student(y_t) - log pi_teacher(y_t)`` at each token the
    student generated, enters as ``A_t = A_task - coef * k_t`` (``task_reward=False``:
    ``A_t = -coef * k_t``). Each token is credited with its own term only (no sum over later
    tokens): minimising ``E_student[sum_t k_t]`` token by token, as in on-policy distillation
    (Agarwal et al. 2024, arXiv 2306.13649, with the reverse KL; Lu & Thinking Machines 2025).
    Only the student's own tokens (``mask``) get one: an env's or tool's tokens are not scored.

    Args:
        advantages: the task's. Shape: (B,) or (B, T)
        student_logp: the student's behaviour log-probs (no gradient). Shape: (B, T)
        teacher_logp: Shape: (B, T)
        mask: the student's action tokens. Shape: (B, T)

    Returns:
        (advantages of Shape (B, T), metrics ``distill/reverse_kl`` (the per-token mean) and
        ``distill/teacher_logp``)
    """
    m = mask.to(student_logp.dtype)
    k = (student_logp.detach() - teacher_logp.detach()) * m
    task = advantages.unsqueeze(-1).expand_as(k) if advantages.dim() == 1 else advantages
    adv = (task * m if task_reward else torch.zeros_like(k)) - coef * k
    metrics = {
        "distill/reverse_kl": masked_mean(k, mask),
        "distill/teacher_logp": masked_mean(teacher_logp.detach(), mask),
    }
    return adv, metrics


def finalize_rewards(
    result: RolloutResult, reward: Any, pad_token_id: int, world_size: int, device: torch.device
) -> RolloutResult:
    """The step's training rewards once its batch is final (after every refill round): the
    ``reward`` group's batch-normalised components standardised over every rank's batch (a
    collective), the batch collated again with them. ``reward``: the harness's reward group,
    or None (the env's rewards stand)."""
    if reward is None:
        return result
    metrics = reward.finalize(result.trajectories, lambda t: all_sum(t, world_size), device=device)
    batch = collate(result.trajectories, pad_token_id)
    return RolloutResult(batch, result.trajectories, {**result.metrics, **metrics})
