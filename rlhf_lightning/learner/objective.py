"""The whole loss of a micro-batch, owned by one object per configured objective.

``micro_step`` only builds a :class:`MicroBatch` and calls the objective; everything that makes
up the loss lives here once: the policy term (a registered objective with its bound
hyper-parameters), corrections (truncated importance weights; masks arrive in ``mask``), the
KL term, an entropy bonus and a critic term. The Liger kernel is a second implementation of the
same interface (:mod:`rlhf_lightning.learner.liger_path`), tested equal to this one.

Notation:
    b: trajectories in the micro-batch, T: its token positions (L-1), S: steps (turns/tokens).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, Protocol

import torch

from rlhf_lightning.config.algo import node_params, registered_name
from rlhf_lightning.learner.critic import reduce_to_steps
from rlhf_lightning.learner.records import CriticTargets, Metrics, Scored
from rlhf_lightning.losses import aggregate, get_policy_loss, kl
from rlhf_lightning.losses.corrections import truncated_importance_weights
from rlhf_lightning.losses.masked import masked_mean
from rlhf_lightning.losses.policy import POLICY_LOSSES, loss_kwargs
from rlhf_lightning.losses.value import clipped_value_loss
from rlhf_lightning.models.policy import Policy
from rlhf_lightning.records.trajectory import TrajectoryBatch

Backward = Callable[[torch.Tensor], None]


@dataclass
class MicroBatch:
    """The rows of one micro-batch and the per-row quantities the loss uses.

    Shapes:
        sub: the rows, columns trimmed to their longest sequence (T = its L-1)
        index: their rows in the rollout batch. (b,)
        adv: per trajectory (b,) or per token (b, T)
        mask: the tokens that count (action tokens minus masked ones). (b, T)
        old_logp: the trainer's behaviour log-probs, None when on-policy. (b, T)
        ref_logp: the reference's log-probs, None without a KL loss term. (b, T)
        critic: the rows' value targets (a critic family), else None.
    """

    sub: TrajectoryBatch
    index: torch.Tensor
    adv: torch.Tensor
    mask: torch.Tensor
    old_logp: torch.Tensor | None
    ref_logp: torch.Tensor | None
    critic: CriticTargets | None = None

    @classmethod
    def rows_of(
        cls,
        traj: TrajectoryBatch,
        scored: Scored,
        index: torch.Tensor,
        old_logp: torch.Tensor | None,
        ref_logp: torch.Tensor | None,
    ) -> MicroBatch:
        """Rows ``index`` of a scored batch, every per-token tensor trimmed to the rows' longest
        sequence. Shapes: old_logp, ref_logp (B, T) or None; index (b,)"""
        sub = traj.select(index)
        width = sub.action_mask.shape[1]
        adv = scored.adv
        return cls(
            sub=sub,
            index=index,
            adv=adv[index] if adv.dim() == 1 else adv[index][:, :width],
            mask=scored.mask[index][:, :width],
            old_logp=None if old_logp is None else old_logp[index][:, :width],
            ref_logp=None if ref_logp is None else ref_logp[index][:, :width],
            critic=scored.critic.rows(index, width) if scored.critic is not None else None,
        )


class Objective(Protocol):
    """``(policy, micro-batch, window normalisers, backward) -> (scalar loss, metrics)``.

    ``actor=False`` computes only the terms that do not train the actor (PPO's critic warm-up).
    A term may back-propagate itself through ``backward`` and leave it out of the returned
    loss (a separate pass frees the actor's activations first).
    """

    def __call__(
        self, policy: Policy, mb: MicroBatch, norm: dict[str, Any], backward: Backward, actor: bool = True
    ) -> tuple[torch.Tensor, Metrics]: ...


@dataclass(frozen=True)
class PolicyTerm:
    """A registered objective with its hyper-parameters bound (``algo.loss`` + its params class)."""

    name: str
    kwargs: dict[str, Any]
    per_turn: bool = False  # pass turn ids (GSPO pooled per turn)

    @classmethod
    def bind(cls, loss: Any, hp: Any, per_turn: bool = False) -> PolicyTerm:
        """The loss ``loss`` (``algo.loss``: a ``{name, <params>}`` node or a name) with its params
        class's fields bound by name from ``hp`` (a field the config does not have keeps the
        class's default), then ``hp.loss_kwargs`` and the node's own params on top (checked at
        start-up against the class's fields)."""
        name = registered_name(loss)
        meta = POLICY_LOSSES.meta(name)
        params = meta["params"]
        bound = params(**{f.name: getattr(hp, f.name) for f in fields(params) if hasattr(hp, f.name)})
        extra = {**dict(getattr(hp, "loss_kwargs", None) or {}), **node_params(loss)}
        kwargs = {**loss_kwargs(bound), **extra}
        return cls(name, kwargs, per_turn and meta.get("takes_turn_ids", False))

    def __call__(
        self,
        logp: torch.Tensor,
        old: torch.Tensor,
        adv: torch.Tensor,
        mask: torch.Tensor,
        turn_ids: torch.Tensor,
    ) -> tuple[torch.Tensor, Metrics]:
        extra = {"turn_ids": turn_ids} if self.per_turn else {}
        return get_policy_loss(self.name)(logp, old, adv, mask, **self.kwargs, **extra)


@dataclass(frozen=True)
class KLTerm:
    """``beta * KL(pi || ref)`` per token in the loss (``algo.kl_mode=loss``)."""

    beta: float
    estimator: str = "k3"
    clamp: float | None = 10.0
    importance_weighted: bool = False

    def __call__(
        self, logp: torch.Tensor, ref: torch.Tensor, old: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, Metrics]:
        kl_t = kl(logp, ref, self.estimator)
        term = kl_t.clamp(-self.clamp, self.clamp) if self.clamp is not None else kl_t
        if self.importance_weighted:
            # E_old[r * k3] is KL(pi || ref) itself: value and gradient unbiased (DeepSeek-V3.2, sec. 3.1)
            term = term * torch.exp(logp - old)
        metrics = {"actor/kl": masked_mean(kl_t.detach(), mask)}
        if self.clamp is not None:
            metrics["actor/kl_clamp_frac"] = masked_mean((kl_t.detach().abs() > self.clamp).float(), mask)
        return self.beta * term, metrics


@dataclass(frozen=True)
class TeacherKLTerm:
    """On-policy distillation with the exact reverse KL (``algo.distill.estimator=full``):
    ``coef * KL(pi_student || pi_teacher)`` over the whole vocabulary at each token the
    student generated, a loss term with its own gradient (not a REINFORCE advantage).
    ``teacher``: the teacher's policy, on the trainer's device for the update."""

    coef: float
    teacher: Policy


class CriticTerm:
    """PPO's clipped value loss over steps, normalised by the window's step count; the targets
    arrive with each micro-batch (``mb.critic``)."""

    def __init__(self, vf_coef: float, value_clip: float | None, reduction: str, separate_pass: bool) -> None:
        self.vf_coef, self.value_clip, self.reduction = vf_coef, value_clip, reduction
        self.separate_pass = separate_pass

    def __call__(
        self, policy: Policy, mb: MicroBatch, norm: dict[str, Any], backward: Backward, actor: bool = True
    ) -> tuple[torch.Tensor, Metrics]:
        if mb.critic is None:
            raise RuntimeError("the critic term needs the micro-batch's value targets (mb.critic)")
        t = mb.critic
        values = policy.forward_heads(mb.sub, ("value",))["value"]  # (b, T)
        step_v = reduce_to_steps(
            values, t.steps_idx[:, : values.shape[1]], t.returns.shape[1], self.reduction
        )
        mask = t.step_mask  # (b, S)
        per_step, m = clipped_value_loss(step_v, t.old_values, t.returns, mask, self.value_clip)
        loss = self.vf_coef * (per_step * mask).sum() / norm["num_steps"]
        metrics = {
            "critic/value_loss": ((per_step * mask).sum() / mask.sum().clamp(min=1)).detach(),
            "critic/vf_clipfrac": m["vf_clipfrac"],
        }
        if self.separate_pass and actor:
            backward(loss)  # its own pass: the actor's activations are already freed
            return torch.zeros((), device=loss.device), metrics
        return loss, metrics


class PolicyObjective:
    """The standard implementation: chunked log-probs, then every term of the loss.

    Args:
        term: the policy-gradient term.
        agg_mode, max_len: :func:`aggregate`'s mode and ``seq_mean_token_sum_norm`` constant.
        temperature, chunk_rows: for the log-prob pass (the sampling temperature).
        kl_term: a KL loss term, or None.
        entropy_coef: entropy bonus weight (0: no entropy is computed).
        tis_cap: truncated importance weights trainer/engine (None: off).
        critic: a critic term trained in the same micro-step, or None.
        teacher_kl: on-policy distillation's exact reverse-KL term, or None.
    """

    def __init__(
        self,
        term: PolicyTerm,
        *,
        agg_mode: str = "token_mean",
        max_len: int = 1,
        temperature: float = 1.0,
        chunk_rows: int | None = None,
        kl_term: KLTerm | None = None,
        entropy_coef: float = 0.0,
        tis_cap: float | None = None,
        critic: CriticTerm | None = None,
        teacher_kl: TeacherKLTerm | None = None,
    ) -> None:
        self.term, self.agg_mode, self.max_len = term, agg_mode, max_len
        self.teacher_kl = teacher_kl
        self.temperature, self.chunk_rows = temperature, chunk_rows
        self.kl_term, self.entropy_coef, self.tis_cap, self.critic = kl_term, entropy_coef, tis_cap, critic

    def with_term(self, term: PolicyTerm) -> PolicyObjective:
        """The same objective with another policy-gradient term."""
        other = copy.copy(self)
        other.term = term
        return other

    def __call__(
        self, policy: Policy, mb: MicroBatch, norm: dict[str, Any], backward: Backward, actor: bool = True
    ) -> tuple[torch.Tensor, Metrics]:
        if not actor:
            if self.critic is None:
                raise RuntimeError("actor=False needs a critic term")
            return self.critic(policy, mb, norm, backward, actor=False)
        heads = ("logp", "entropy") if self.entropy_coef > 0 else ("logp",)
        teacher = None
        if self.teacher_kl is not None:
            heads, teacher = (*heads, "teacher_kl"), self.teacher_kl.teacher
        out = policy.forward_heads(
            mb.sub, heads, temperature=self.temperature, chunk_rows=self.chunk_rows, teacher=teacher
        )
        logp, mask = out["logp"], mb.mask
        old = logp.detach() if mb.old_logp is None else mb.old_logp  # on-policy: ratio 1
        per_token, m = self.term(logp, old, mb.adv, mask, mb.sub.turn_ids)
        metrics = {f"actor/{k}": v for k, v in m.items()}
        if self.tis_cap is not None:
            # The engine sampled these tokens; reweight to the trainer's policy (truncated IS).
            w, tm = truncated_importance_weights(old, mb.sub.sampling_logps, mask, self.tis_cap)
            per_token = per_token * w
            metrics.update({f"is/{k}": v for k, v in tm.items()})
        if self.kl_term is not None and mb.ref_logp is not None:
            kl_tokens, km = self.kl_term(logp, mb.ref_logp, old, mask)
            per_token = per_token + kl_tokens
            metrics.update(km)
        if self.teacher_kl is not None:
            per_token = per_token + self.teacher_kl.coef * out["teacher_kl"]
            metrics["distill/reverse_kl"] = masked_mean(out["teacher_kl"].detach(), mask)
        if "entropy" in out:
            per_token = per_token - self.entropy_coef * out["entropy"]
            metrics["actor/entropy"] = masked_mean(out["entropy"].detach(), mask)
        loss = aggregate(
            per_token,
            mask,
            self.agg_mode,
            max_len=self.max_len,
            num_tokens=norm["num_tokens"],
            num_seqs=norm["num_seqs"],
        )
        metrics["actor/loss_part"] = loss.detach()
        if self.critic is not None:
            critic_loss, cm = self.critic(policy, mb, norm, backward, actor=True)
            metrics.update(cm)
            loss = loss + critic_loss
        return loss, metrics
