"""One training skeleton for every rollout algorithm.

    rows -> rollout (generate with the current policy, score in the env)
         -> no-grad old / reference log-probs (only when needed)
         -> rewards -> advantages; the tokens that count (truncation, off-policy masks)
         -> for epoch, mini-batch, micro-batch: loss -> manual_backward -> clip -> step
         -> namespaced metrics

Subclasses override :meth:`compute_advantages` and :meth:`policy_term` (and may add a critic
through :meth:`critic_term`, or change how rollouts are collected); the loss of a micro-batch
is one :class:`~rlhf_lightning.learner.objective.Objective`; the rest lives here once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from rlhf_lightning.algorithms.common import MetricAccumulator, Metrics
from rlhf_lightning.algorithms.diagnostics import rollout_metrics, sample_rows, warn_on_engine_gap
from rlhf_lightning.algorithms.evaluation import RolloutEvaluation
from rlhf_lightning.algorithms.population_step import PopulationStep
from rlhf_lightning.config.algo import RolloutAlgoConfig
from rlhf_lightning.data.resumable import rows_of_batch
from rlhf_lightning.learner.liger_path import use_liger
from rlhf_lightning.learner.objective import CriticTerm, MicroBatch, Objective, PolicyTerm
from rlhf_lightning.learner.objective_build import build_objective
from rlhf_lightning.learner.optimizer import adamw_with_schedule, total_optimizer_steps
from rlhf_lightning.learner.plan import UpdatePlan, no_grad_head
from rlhf_lightning.learner.records import Advantages, Scored, UpdateInputs
from rlhf_lightning.learner.scoring import Scorer, finalize_rewards
from rlhf_lightning.models.policy import Policy
from rlhf_lightning.models.sharding import gathered
from rlhf_lightning.rollout.async_rollout import AsyncRollouts, BatchSource
from rlhf_lightning.rollout.collector import Collector
from rlhf_lightning.rollout.engine import RolloutEngine, SamplingParams
from rlhf_lightning.rollout.harness import RolloutHarness, RolloutResult
from rlhf_lightning.rollout.hooks import RolloutHooks, hook_callbacks
from rlhf_lightning.rollout.trajectory import TrajectoryBatch


def actor_source(
    policy: Any, rank: int, loader: Callable[[], Any], world_size: int = 1, device: str = "cpu"
) -> BatchSource:
    """The producer's view of the trainer: ``rank``, a CPU copy of ``policy``'s actor weights
    (by the role the policy was built with), the rows of the train ``loader()``'s future batches,
    the number of ranks and the trainer's ``device``."""
    actor = policy.roles["actor"]

    def weights() -> dict[str, torch.Tensor]:
        return {n: p.detach().to("cpu", copy=True) for n, p in policy.named_parameters() if n in actor}

    return BatchSource(rank, weights, lambda b: rows_of_batch(loader(), b), world_size, device)


class RolloutModule(PopulationStep, RolloutEvaluation):
    """The rollout-algorithm skeleton (manual optimization).

    Args:
        policy: the trainable policy (actor adapter or full model, plus its reference).
        harness: turns task rows into scored trajectory batches.
        engine: the rollout engine (HF ``generate`` on the policy, or vLLM).
        sampling: training sampling parameters (``n`` is ignored: see ``hp.group_size``).
        hp: the algorithm's config dataclass (e.g. :class:`~rlhf_lightning.config.GRPOConfig`).
        eval_greedy, eval_sampled: which evaluations the validation loop runs.
        num_train_rows: rows in the env's train split (to draw extra prompts from).
    """

    generates_in_training_step = True
    hp: RolloutAlgoConfig

    def __init__(
        self,
        policy: Policy,
        harness: RolloutHarness,
        engine: RolloutEngine,
        sampling: SamplingParams,
        hp: RolloutAlgoConfig,
        *,
        eval_greedy: bool = True,
        eval_sampled: bool = True,
        num_samples_to_keep: int = 4,
        num_train_rows: int | None = None,
        eval_num_samples: int = 1,
        async_rollouts: AsyncRollouts | None = None,
    ) -> None:
        super().__init__(policy, hp)
        self.collector = Collector(async_rollouts)  # the training rollouts: now, or from the producer
        self.harness = harness
        self.engine = engine
        self.sampling = sampling
        self.eval_greedy, self.eval_sampled, self.eval_num_samples = (
            eval_greedy,
            eval_sampled,
            eval_num_samples,
        )
        self.num_samples_to_keep = num_samples_to_keep
        self.num_train_rows = num_train_rows
        self.last_samples: list[dict[str, Any]] = []
        self.last_eval_step = -1
        self._eval_outputs = {}
        self._warned_gap_at = -(10**9)
        self.use_liger = False
        self.objective: Objective | None = None

    # ---------------------------------------------------------------- hooks for subclasses
    def compute_advantages(
        self, traj: TrajectoryBatch, rewards: torch.Tensor, returns: torch.Tensor
    ) -> torch.Tensor | Advantages:
        """Advantages per trajectory (B,) or per token (B, L-1) from the shaped per-turn rewards
        (B, K) and episode returns (B,) (their sum, plus a KL penalty in ``kl_mode=reward``): a
        tensor, or an :class:`Advantages` record when there is more to pass on (a critic's
        targets, the level the steps were taken at, diagnostics).

        With ``kl_mode=reward``, a family with ``per_token_kl_reward = True`` (PPO) is called
        through :meth:`advantages_with_kl_rewards` instead."""
        raise NotImplementedError

    # Whether ``kl_mode=reward`` reaches the advantages per token (``-beta * kl_t`` as each
    # token's reward) rather than summed into the returns (outcome-level advantages only see
    # the sum anyway).
    per_token_kl_reward = False

    def advantages_with_kl_rewards(
        self, traj: TrajectoryBatch, rewards: torch.Tensor, returns: torch.Tensor, kl_rewards: torch.Tensor
    ) -> torch.Tensor | Advantages:
        """:meth:`compute_advantages` with per-token rewards ``kl_rewards`` (B, L-1) on top of the
        per-turn ``rewards`` (``returns`` without them); for ``per_token_kl_reward`` families."""
        raise NotImplementedError

    def policy_term(self) -> PolicyTerm:
        """The policy-gradient term of the objective, its hyper-parameters bound."""
        raise NotImplementedError

    def critic_term(self) -> CriticTerm | None:
        """A critic trained with the actor (PPO), or None."""
        return None

    def entropy_coef(self) -> float:
        return 0.0

    def collect(self, rows: list[int]) -> tuple[RolloutResult, Metrics]:
        """Training rollouts for ``rows`` (GRPO's dynamic sampling overrides this)."""
        return self.training_rollout(rows)

    def training_rollout(self, rows: list[int]) -> tuple[RolloutResult, Metrics]:
        """This step's episodes for ``rows``: generated now with the current weights, or with
        ``rollout.mode=async`` the producer's batch (generated ahead, with its versions)."""
        return self.collector.collect(
            rows,
            lambda r: self.rollout(r, self.sampling, group_size=self.hp.group_size),
            self.sampling,
            self.hp.group_size,
            self.producer_view,
        )

    def producer_view(self) -> BatchSource:
        """What the producer needs of this trainer (``rollout.mode=async``): :func:`actor_source`."""
        return actor_source(
            self.policy, self.rank, lambda: self.trainer.train_dataloader, self.world_size, str(self.device)
        )

    def on_fit_start(self) -> None:
        self.objective = self.build_objective()

    def adopt_member(self, hp: RolloutAlgoConfig, sampling: SamplingParams, counters: dict[str, int]) -> None:
        """A round-robin population's resident member (``population/resident.py``): its
        hyper-parameters, sampling and counters (PPO's ``learn_steps``), and the objective they
        give. The one way a member's state enters the module from outside."""
        for name, value in counters.items():
            setattr(self, name, value)
        self.hp, self.sampling = hp, sampling
        self.objective = self.build_objective()

    def current_objective(self) -> Objective:
        """The objective built at fit start (or now, outside a fit)."""
        if self.objective is None:
            self.objective = self.build_objective()
        return self.objective

    def build_objective(self) -> Objective:
        """The micro-batch loss: Liger's fused kernel (GPU, ``algo.use_liger_loss``) or ours."""
        self.use_liger = use_liger(self.hp, self.device)
        return build_objective(
            self.hp,
            self.policy_term,
            critic=self.critic_term(),
            entropy_coef=self.entropy_coef(),
            temperature=self.sampling.temperature,
            max_len=self.max_len_norm,
            world_size=self.world_size,
            liger=self.use_liger,
        )

    # ---------------------------------------------------------------- the training step
    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        if self.members is not None:  # a population side by side: one rollout, each member's update
            return self.population_step(batch)
        t_start = time.perf_counter()
        with gathered(self.policy):  # FSDP: full weights, so ranks generate independently
            # 1. Rollout: group_size episodes per prompt row, sampled from the current policy.
            result, metrics = self.collect(batch.tolist())
            result = self.finalize_rewards(result)
            self.rollouts_done()
            self.report_phase("log-probs and advantages")
            t_rollout = time.perf_counter() - t_start
            # 2-3. The log-probs the update needs, then rewards -> advantages.
            traj, scored, old_logp, ref_logp = self.scored_batch(result, self.collector.is_stale(result))
            metrics.update(scored.metrics)
        # 4. Optimize: update_epochs x mini-batches, each accumulated over micro-batches.
        metrics.update(self.update(traj, scored, old_logp, ref_logp))
        # The step is done: with rollout.mode=async the new weights go to the producer.
        self.collector.step_done(self.sampling, self.hp.group_size, self.producer_view)
        # 5. Log.
        step_s = time.perf_counter() - t_start
        metrics.update(rollout_metrics(traj, result.metrics))
        metrics["perf/step_s"] = torch.tensor(step_s)
        metrics["perf/rollout_s"] = torch.tensor(t_rollout)
        metrics["perf/tokens_per_s"] = traj.action_mask.sum().float().cpu() / step_s
        self.log_step(metrics)
        self.log("reward", metrics["rollout/reward_mean"], prog_bar=True, logger=False)
        self.warn_on_engine_gap(metrics)
        self.keep_samples(result)

    def scored_batch(
        self, result: RolloutResult, stale: bool = False
    ) -> tuple[TrajectoryBatch, Scored, torch.Tensor | None, torch.Tensor | None]:
        """One batch of finalised episodes made ready for :meth:`update`: the batch on the device,
        scored, and its behaviour and reference log-probs.

        2. The log-probs the update needs, once, without gradients (behaviour log-probs None:
           on-policy, the update's own, detached; never for a ``stale`` batch).
        3. Score: rewards -> advantages; pick the tokens that count in the loss.
        """
        traj = result.batch.to(self.device)
        old_logp = self.old_logprobs(traj, stale=stale)
        ref_logp = self.batched_logprobs(traj, reference=True) if self.hp.beta > 0 else None
        return traj, self.score(traj, old_logp, ref_logp), old_logp, ref_logp

    def finalize_rewards(self, result: RolloutResult) -> RolloutResult:
        """The step's training rewards once its batch is final (after every refill round): the
        ``reward`` group's batch-normalised components standardised over every rank's batch."""
        return finalize_rewards(
            result, self.harness.reward, self.harness.tokenizer.pad_token_id, self.world_size, self.device
        )

    def rollout_hooks(self) -> list[RolloutHooks]:
        """The trainer's callbacks that take this module's own hooks (:class:`RolloutHooks`)."""
        return hook_callbacks(self.trainer if self._trainer is not None else None)

    def report_phase(self, text: str) -> None:
        """Tell the hook callbacks (the progress bar) where the step is."""
        for cb in self.rollout_hooks():
            cb.on_phase(self.trainer, self, text)

    def rollouts_done(self) -> None:
        """Rollouts are collected: callbacks may put the engine to sleep before training."""
        for cb in self.rollout_hooks():
            cb.on_rollout_end(self.trainer, self)

    @property
    def plan(self) -> UpdatePlan:
        """The per-rank batch sizes of the update, from the current hyper-parameters (a
        population member's group size may differ)."""
        return UpdatePlan.from_hp(self.hp, self.world_size)

    def old_logprobs(self, traj: TrajectoryBatch, stale: bool = False) -> torch.Tensor | None:
        """The behaviour log-probs the ratios use.

        ``old_logprobs_source=rollout``: the engine's sampling log-probs (no extra pass).
        ``trainer``: a no-grad pass, skipped when the update is on-policy and nothing before the
        update needs them (off-policy masking, KL in reward or advantages). A ``stale`` batch
        (asynchronous rollouts) is never on-policy: the pass gives the proximal log-probs, and
        truncated importance weights (``tis_cap``) correct them to the engine's.
        """
        if self.hp.old_logprobs_source == "rollout":
            return traj.sampling_logps
        needed_before_update = (
            self.hp.offpolicy_token_bounds is not None
            or self.hp.offpolicy_seq_threshold is not None
            or (self.hp.beta > 0 and self.hp.kl_mode != "loss")
        )
        if self.plan.is_on_policy(len(traj)) and not needed_before_update and not stale:
            return None
        return self.batched_logprobs(traj)

    def batched_logprobs(self, traj: TrajectoryBatch, reference: bool = False) -> torch.Tensor:
        """No-grad log-probs of every action token, micro-batch by micro-batch. Shape: (B, L-1)"""
        return no_grad_head(
            self.policy, traj, self.plan, "logp", self.sampling.temperature, self.hp.chunk_rows, reference
        )

    # ---------------------------------------------------------------- scoring
    def score(
        self, traj: TrajectoryBatch, old_logp: torch.Tensor | None, ref_logp: torch.Tensor | None
    ) -> Scored:
        """Shaped returns -> advantages, and the loss mask (action tokens that count): the
        :class:`~rlhf_lightning.learner.scoring.Scorer` of the current hyper-parameters
        (a population member's may differ) with this family's advantage estimator."""
        scorer = Scorer.from_hp(self.hp, self.sampling.max_new_tokens, self.per_token_kl_reward)
        return scorer(traj, old_logp, ref_logp, self.compute_advantages, self.advantages_with_kl_rewards)

    # ---------------------------------------------------------------- the update
    def update(
        self,
        traj: TrajectoryBatch,
        scored: Scored,
        old_logp: torch.Tensor | None,
        ref_logp: torch.Tensor | None,
    ) -> Metrics:
        """``update_epochs`` passes over the batch, one optimizer step per mini-batch. Every rank
        takes the same number of optimizer steps; micro-batch counts may differ freely."""
        sched = self.current_scheduler()
        plan, n, mask = self.plan, len(traj), scored.mask
        step = UpdateInputs(
            traj, scored, old_logp, ref_logp, self.objective_for(scored), plan.row_lengths(traj)
        )
        # Rows whose advantage is 0 everywhere add no gradient unless a KL loss term is used.
        seq_adv = (scored.adv if scored.adv.dim() == 1 else (scored.adv * mask).abs().sum(-1)) * mask.any(-1)
        skip_zero = not (self.hp.beta > 0 and self.hp.kl_mode == "loss") and self.can_skip_zero_advantage()
        minis = plan.mini_batch_count(n, self.device)
        acc = MetricAccumulator()
        for epoch in range(plan.update_epochs):
            for j, mb in enumerate(plan.epoch_batches(n, minis, self.device)):
                self.report_phase(f"update {epoch * minis + j + 1}/{plan.update_epochs * minis}")
                run = mb[seq_adv[mb] != 0] if skip_zero else mb
                self.mini_batch_step(step, mb, run, plan.mini(n), acc)
        out = acc.result()
        out["actor/lr"] = torch.tensor(sched.get_last_lr()[0])
        out["actor/skipped_rows_frac"] = (seq_adv == 0).float().mean() if skip_zero else torch.zeros(())
        return {k: v.detach().float().cpu() for k, v in out.items()}

    def mini_batch_step(
        self, step: UpdateInputs, mb: torch.Tensor, run: torch.Tensor, mini: int, acc: MetricAccumulator
    ) -> None:
        """One optimizer step on mini-batch ``mb`` (row indices), accumulated over micro-batches of
        the rows that ``run``; normalised by the whole mini-batch, global over ranks."""
        norm = self.normalisers(step.scored.mask[mb], mb, step.scored)
        actor = self.actor_loss_enabled()
        zero = torch.zeros((), device=self.device)
        mb_loss, mb_actor = zero, zero
        for index, weight in self.lockstep(self.plan.micro_chunks(run, step.lengths, mini)):
            loss, m = self.micro_step(step, index, norm, actor, weight)
            self.backward_(loss)
            if not weight:
                continue  # FSDP padding: same passes as the other ranks, no gradient
            mb_loss = mb_loss + loss.detach()
            mb_actor = mb_actor + m.pop("actor/loss_part", zero)
            acc.add(m, weight=step.scored.mask[index].sum())
        grad_metrics = self.optimizer_step_()
        acc.add({"actor/loss": mb_actor, "train/loss": mb_loss, **grad_metrics})

    def actor_loss_enabled(self) -> bool:
        """False while only a critic trains (PPO's critic warm-up)."""
        return True

    def can_skip_zero_advantage(self) -> bool:
        """Whether rows with zero advantage may be left out of forward/backward (same gradient)."""
        return False

    def normalisers(self, mask: torch.Tensor, rows: torch.Tensor, scored: Scored) -> dict[str, Any]:
        """:func:`aggregate`'s denominators for a mini-batch (``mask`` = its loss mask, ``rows`` its
        indices in the ``scored`` batch).

        Summed over ranks, then divided by the world size to undo DDP's gradient averaging, so
        the update equals the one of the global mini-batch.
        """
        return {
            "num_tokens": self.global_count(mask.sum().float()),
            "num_seqs": self.global_count(torch.tensor(float(mask.shape[0]), device=mask.device)),
        }

    def objective_for(self, scored: Scored) -> Objective:
        """The micro-batch loss for this scored batch (PPO picks its ratio level from it)."""
        return self.current_objective()

    def micro_step(
        self,
        step: UpdateInputs,
        index: torch.Tensor,
        norm: dict[str, Any],
        actor: bool = True,
        weight: float = 1.0,
    ) -> tuple[torch.Tensor, Metrics]:
        """The loss of micro-batch ``index``, already normalised for the whole mini-batch, times
        ``weight`` (0 for FSDP's padding micro-batches; a separate critic pass is scaled too)."""
        ref = step.ref_logp if self.hp.kl_mode == "loss" else None
        mb = MicroBatch.rows_of(step.traj, step.scored, index, step.old_logp, ref)
        if weight == 1.0:
            return step.objective(self.policy, mb, norm, self.backward_, actor)
        loss, m = step.objective(self.policy, mb, norm, lambda part: self.backward_(part * weight), actor)
        return loss * weight, m

    @property
    def max_len_norm(self) -> int:
        return self.hp.max_len_norm or self.sampling.max_new_tokens

    # ---------------------------------------------------------------- metrics and samples
    def warn_on_engine_gap(self, metrics: Metrics) -> None:
        """Warn (at most every 100 steps) when the engine and the trainer disagree noticeably."""
        if self.global_step - self._warned_gap_at >= 100 and warn_on_engine_gap(metrics, self.hp.tis_cap):
            self._warned_gap_at = self.global_step

    def keep_samples(self, result: RolloutResult) -> None:
        self.last_samples = sample_rows(result.trajectories[: self.num_samples_to_keep])

    # ---------------------------------------------------------------- state and workers
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["collector"] = self.collector.state_dict()
        if self.members is not None:
            checkpoint["members"] = self.member_checkpoint()

    def checkpoint_keys(self) -> set[str]:
        keys = super().checkpoint_keys()
        return keys | self.member_checkpoint_keys() if self.members is not None else keys

    def maybe_update_reference(self) -> None:
        if self.members is not None:  # each member's own reference, on its own count
            self.refresh_member_reference()
        else:
            super().maybe_update_reference()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        steps = checkpoint.get("global_step", 0) // max(self.steps_per_batch(), 1)
        self.collector.load_state_dict(checkpoint.get("collector", {}), steps)
        if self.members is not None and "members" in checkpoint:
            self.load_member_checkpoint(checkpoint["members"])

    def close(self) -> None:
        """Stop the rollout producer (``rollout.mode=async``) and the env's workers; the run
        calls this at its end."""
        self.collector.close()
        super().close()

    def teardown(self, stage: str) -> None:
        self.close()

    # ---------------------------------------------------------------- optimisation
    def configure_optimizers(self) -> Any:
        if self.members is not None:  # one optimizer and schedule per member, over its own steps
            self.check_population_steps()
            return self.member_optimizers(max(self.total_optimizer_steps() // self.members.size, 1))
        return adamw_with_schedule(self.param_groups(self.hp), self.hp, self.total_optimizer_steps())

    def param_groups(self, hp: RolloutAlgoConfig) -> list[dict[str, Any]]:
        """The optimizer's parameter groups under config ``hp`` (a group may set its own ``lr``)."""
        return [{"params": self.policy.trainable_parameters()}]

    def steps_per_batch(self) -> int:
        """Optimizer steps one training step takes: every member's with a population side by side."""
        per = self.plan.optimizer_steps_per_batch()
        return per * (self.members.size if self.members is not None else 1)

    def total_optimizer_steps(self) -> int:
        return total_optimizer_steps(self._trainer, self.steps_per_batch())
