"""The learner: one member's scoring and update of one rollout batch, with explicit inputs.

    score(traj, member):  behaviour / reference log-probs (no grad, only when needed)
                          -> shaped rewards -> the family's advantages -> the loss mask
    update(traj, scored, member):
                          for epoch, mini-batch, micro-batch: loss -> backward -> clip -> step

Everything a member is (hyper-parameters, sampling, optimizer, counters, guard record) comes in
as the :class:`~rlhf_lightning.learner.member.Member`; what the algorithm adds comes from its
:class:`~rlhf_lightning.learner.family.Family`. The learner keeps no state between calls but the
objectives it built for each member.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

from rlhf_lightning.learner.family import Family
from rlhf_lightning.learner.liger_path import use_liger
from rlhf_lightning.learner.member import Member
from rlhf_lightning.learner.objective import MicroBatch, Objective
from rlhf_lightning.learner.objective_build import build_objective
from rlhf_lightning.learner.plan import UpdatePlan, no_grad_head
from rlhf_lightning.learner.records import Metrics, Scored, UpdateInputs
from rlhf_lightning.learner.scoring import Scorer
from rlhf_lightning.learner.stepper import Stepper
from rlhf_lightning.learner.teacher import distills_full_kl
from rlhf_lightning.records.trajectory import TrajectoryBatch


class MetricAccumulator:
    """Averages detached metrics over micro-batches (weighted) and updates; ``*_max`` keys keep the max."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.weights: dict[str, torch.Tensor] = {}

    def add(self, metrics: Metrics, weight: torch.Tensor | float = 1.0) -> None:
        for k, v in metrics.items():
            v = v.detach().float()
            if k.endswith("_max"):
                self.sums[k] = torch.maximum(self.sums[k], v) if k in self.sums else v
                self.weights[k] = torch.ones((), device=v.device)
                continue
            w = torch.as_tensor(weight, dtype=torch.float32, device=v.device)
            self.sums[k] = self.sums.get(k, 0) + v * w
            self.weights[k] = self.weights.get(k, 0) + w

    def result(self) -> Metrics:
        return {k: self.sums[k] / self.weights[k].clamp(min=1e-12) for k in self.sums}


class Learner:
    """Args:
    policy: the trainable policy (actor, reference, critic on one base).
    family: the algorithm's strategy.
    stepper: the module's backward passes and optimizer steps.
    report: where the step is (the progress bar), e.g. ``"update 2/4"``.
    global_step: optimizer steps done (a shared reference refreshes on it).
    teacher: on-policy distillation's teacher (:class:`~rlhf_lightning.learner.teacher.Teacher`),
        or None.
    """

    def __init__(
        self,
        policy: Any,
        family: Family,
        stepper: Stepper,
        report: Callable[[str], None] = lambda text: None,
        global_step: Callable[[], int] = lambda: 0,
        teacher: Any = None,
    ) -> None:
        self.policy, self.family, self.stepper = policy, family, stepper
        self.report, self.global_step = report, global_step
        self.teacher = teacher

    @property
    def device(self) -> torch.device:
        return self.stepper.device

    @property
    def world_size(self) -> int:
        return self.stepper.world_size

    @property
    def rank(self) -> int:
        return self.stepper.rank

    def plan(self, member: Member) -> UpdatePlan:
        """The per-rank batch sizes of ``member``'s update (its group size may differ)."""
        return UpdatePlan.from_hp(member.hp, self.world_size)

    def objective(self, member: Member) -> Objective:
        """``member``'s micro-batch loss (built once for its hyper-parameters): Liger's fused
        kernel (GPU, ``algo.use_liger_loss``) or ours."""
        if "loss" not in member.objectives:
            hp = member.hp
            member.objectives["loss"] = build_objective(
                hp,
                lambda: self.family.policy_term(hp),
                critic=self.family.critic_term(hp),
                entropy_coef=self.family.entropy_coef(hp),
                temperature=member.sampling.temperature,
                max_len=hp.max_len_norm or member.sampling.max_new_tokens,
                world_size=self.world_size,
                liger=use_liger(hp, self.device),
                teacher=None if self.teacher is None else self.teacher.policy,
            )
        return member.objectives["loss"]

    # ---------------------------------------------------------------- scoring
    def logprobs(self, traj: TrajectoryBatch, member: Member, reference: bool = False) -> torch.Tensor:
        """No-grad log-probs of every action token, micro-batch by micro-batch. Shape: (B, T)"""
        hp = member.hp
        plan = self.plan(member)
        return no_grad_head(
            self.policy, traj, plan, "logp", member.sampling.temperature, hp.chunk_rows, reference
        )

    def old_logprobs(self, traj: TrajectoryBatch, member: Member, stale: bool = False) -> torch.Tensor | None:
        """The behaviour log-probs the ratios use.

        ``old_logprobs_source=rollout``: the engine's sampling log-probs (no extra pass).
        ``trainer``: a no-grad pass, skipped when the update is on-policy and nothing before the
        update needs them (off-policy masking, KL in reward or advantages). A ``stale`` batch
        (asynchronous rollouts) is never on-policy: the pass gives the proximal log-probs, and
        truncated importance weights (``tis_cap``) correct them to the engine's.
        """
        hp = member.hp
        if hp.old_logprobs_source == "rollout":
            return traj.sampling_logps
        needed_before_update = (
            hp.offpolicy_token_bounds is not None
            or hp.offpolicy_seq_threshold is not None
            or (hp.beta > 0 and hp.kl_mode != "loss")
        )
        if self.plan(member).is_on_policy(len(traj)) and not needed_before_update and not stale:
            return None
        return self.logprobs(traj, member)

    def score(self, traj: TrajectoryBatch, member: Member, stale: bool = False) -> Scored:
        """``traj`` (on the device) scored for ``member``: its behaviour and reference
        log-probs, shaped returns -> the family's advantages, and the loss mask (the
        :class:`~rlhf_lightning.learner.scoring.Scorer` of the member's hyper-parameters)."""
        old_logp = self.old_logprobs(traj, member, stale=stale)
        ref_logp = self.logprobs(traj, member, reference=True) if member.hp.beta > 0 else None
        teacher_logp = None
        if self.teacher is not None and member.hp.distill.coef != 0 and not distills_full_kl(member.hp):
            self.report("teacher scoring")
            hp = member.hp
            teacher_logp = self.teacher.logprobs(
                traj, self.plan(member), member.sampling.temperature, hp.chunk_rows
            )
        return self.score_with(traj, member, old_logp, ref_logp, teacher_logp)

    def score_with(
        self,
        traj: TrajectoryBatch,
        member: Member,
        old_logp: torch.Tensor | None,
        ref_logp: torch.Tensor | None,
        teacher_logp: torch.Tensor | None = None,
    ) -> Scored:
        """:meth:`score` with the behaviour (None: on-policy), reference (None: no KL) and
        teacher (None: no distillation) log-probs given. Shapes: (B, T)"""
        scorer = Scorer.from_hp(member.hp, member.sampling.max_new_tokens, self.family.per_token_kl_reward)
        family = self.family
        scored = scorer(
            traj,
            old_logp,
            ref_logp,
            lambda t, r, ret: family.advantages(self, member, t, r, ret),
            lambda t, r, ret, kl: family.advantages(self, member, t, r, ret, kl),
            teacher_logp,
        )
        return dataclasses.replace(scored, old_logp=old_logp, ref_logp=ref_logp)

    # ---------------------------------------------------------------- the update
    def update(self, traj: TrajectoryBatch, scored: Scored, member: Member) -> Metrics:
        """``update_epochs`` passes over the batch, one optimizer step per mini-batch. Every rank
        takes the same number of optimizer steps; micro-batch counts may differ freely."""
        hp, family = member.hp, self.family
        plan, n, mask = self.plan(member), len(traj), scored.mask
        objective = family.objective_for(self.objective(member), scored, hp)
        step = UpdateInputs(traj, scored, scored.old_logp, scored.ref_logp, objective, plan.row_lengths(traj))
        # Rows whose advantage is 0 everywhere add no gradient unless a KL loss term is used.
        seq_adv = (scored.adv if scored.adv.dim() == 1 else (scored.adv * mask).abs().sum(-1)) * mask.any(-1)
        full_kl = self.teacher is not None and distills_full_kl(hp)
        loss_terms = (hp.beta > 0 and hp.kl_mode == "loss") or full_kl  # gradient beside the advantage
        skip_zero = not loss_terms and family.can_skip_zero_advantage(hp)
        minis = plan.mini_batch_count(n, self.device)
        acc = MetricAccumulator()
        # the full-vocabulary KL runs the teacher in every micro-batch: on the device for the update
        with self.teacher.on(self.device) if full_kl else nullcontext():
            for epoch in range(plan.update_epochs):
                for j, mb in enumerate(plan.epoch_batches(n, minis, self.device)):
                    self.report(f"update {epoch * minis + j + 1}/{plan.update_epochs * minis}")
                    run = mb[seq_adv[mb] != 0] if skip_zero else mb
                    self.mini_batch_step(step, member, mb, run, plan.mini(n), acc)
        out = acc.result()
        out["actor/lr"] = torch.tensor(self.stepper.scheduler(member.optimizer).get_last_lr()[0])
        out["actor/skipped_rows_frac"] = (seq_adv == 0).float().mean() if skip_zero else torch.zeros(())
        family.learned(member)
        return {k: v.detach().float().cpu() for k, v in out.items()}

    def mini_batch_step(
        self,
        step: UpdateInputs,
        member: Member,
        mb: torch.Tensor,
        run: torch.Tensor,
        mini: int,
        acc: MetricAccumulator,
    ) -> None:
        """One optimizer step on mini-batch ``mb`` (row indices), accumulated over micro-batches of
        the rows that ``run``; normalised by the whole mini-batch, global over ranks (counts
        summed over ranks, then divided by the world size to undo DDP's gradient averaging)."""
        mask = step.scored.mask[mb]
        count = self.stepper.global_count
        norm = {
            "num_tokens": count(mask.sum().float()),
            "num_seqs": count(torch.tensor(float(mask.shape[0]), device=mask.device)),
        }
        norm = self.family.normalisers(self, norm, step.scored, mb)
        actor = self.family.actor_enabled(member)
        zero = torch.zeros((), device=self.device)
        mb_loss, mb_actor = zero, zero
        chunks = self.plan(member).micro_chunks(run, step.lengths, mini)
        for index, weight in self.stepper.lockstep(chunks):
            loss, m = self.micro_step(step, member, index, norm, actor, weight)
            self.stepper.backward(loss)
            if not weight:
                continue  # FSDP padding: same passes as the other ranks, no gradient
            mb_loss = mb_loss + loss.detach()
            mb_actor = mb_actor + m.pop("actor/loss_part", zero)
            acc.add(m, weight=step.scored.mask[index].sum())
        grad_metrics = self.step(member)
        acc.add({"actor/loss": mb_actor, "train/loss": mb_loss, **grad_metrics})

    def micro_step(
        self,
        step: UpdateInputs,
        member: Member,
        index: torch.Tensor,
        norm: dict[str, Any],
        actor: bool = True,
        weight: float = 1.0,
    ) -> tuple[torch.Tensor, Metrics]:
        """The loss of micro-batch ``index``, already normalised for the whole mini-batch, times
        ``weight`` (0 for FSDP's padding micro-batches; a separate critic pass is scaled too)."""
        ref = step.ref_logp if member.hp.kl_mode == "loss" else None
        mb = MicroBatch.rows_of(step.traj, step.scored, index, step.old_logp, ref)
        backward = self.stepper.backward
        if weight == 1.0:
            return step.objective(self.policy, mb, norm, backward, actor)
        loss, m = step.objective(self.policy, mb, norm, lambda part: backward(part * weight), actor)
        return loss * weight, m

    def step(self, member: Member) -> Metrics:
        """``member``'s optimizer step (clipped by its family), then its reference refresh: every
        ``ref_update_interval`` of its own optimizer steps when it has its own reference, else of
        the run's."""
        clip = lambda optimizer: self.family.clip(self, member, optimizer)  # noqa: E731
        metrics = self.stepper.step(member.optimizer, member.health, clip)
        done = (
            self.stepper.scheduler(member.optimizer).last_epoch
            if member.own_reference
            else self.global_step()
        )
        self.stepper.refresh_reference(member.hp.ref_update_interval, done)
        return metrics
