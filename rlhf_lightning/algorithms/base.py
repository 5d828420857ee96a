"""One training skeleton for every rollout algorithm.

    rows -> rollout (generate with the current policy, score in the env)
         -> no-grad old / reference log-probs (only when needed)
         -> rewards -> advantages; the tokens that count (truncation, off-policy masks)
         -> for epoch, mini-batch, micro-batch: loss -> manual_backward -> clip -> step
         -> namespaced metrics

Subclasses override :meth:`compute_advantages` and :meth:`policy_term` (and may add a critic
through :meth:`critic_term`, or change how rollouts are collected); the loss of a micro-batch
is one :class:`~rlhf_lightning.algorithms.objective.Objective`; the rest lives here once.
"""

from __future__ import annotations

import logging
import time
from typing import Any, cast

import torch
from torch.optim.lr_scheduler import LRScheduler

from rlhf_lightning.algorithms.common import MetricAccumulator, Metrics, adamw_with_schedule
from rlhf_lightning.algorithms.diagnostics import turn_metrics
from rlhf_lightning.algorithms.evaluation import RolloutEvaluation
from rlhf_lightning.algorithms.liger_path import LigerObjective, use_liger
from rlhf_lightning.algorithms.microbatch import split_by_tokens, split_rows
from rlhf_lightning.algorithms.objective import (
    CriticTerm,
    KLTerm,
    MicroBatch,
    Objective,
    PolicyObjective,
    PolicyTerm,
)
from rlhf_lightning.algorithms.records import Advantages, Scored
from rlhf_lightning.algorithms.scoring import Scorer
from rlhf_lightning.envs.harness import RolloutHarness, RolloutResult
from rlhf_lightning.envs.trajectory import TrajectoryBatch, collate
from rlhf_lightning.models.policy import Policy
from rlhf_lightning.models.sharding import gathered
from rlhf_lightning.rollout.engine import RolloutEngine, SamplingParams
from rlhf_lightning.rollout.hooks import RolloutHooks
from rlhf_lightning.runtime.distributed import agree_max, all_sum

log = logging.getLogger(__name__)

IS_GAP_WARN, IS_CLIP_WARN = 0.1, 0.02  # nats; share of truncated weights


def _rows(x: torch.Tensor | None, index: torch.Tensor, width: int) -> torch.Tensor | None:
    """Rows ``index`` of a (B, L-1) tensor, trimmed to ``width`` columns."""
    return None if x is None else x[index][:, :width]


class RolloutModule(RolloutEvaluation):
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

    def __init__(
        self,
        policy: Policy,
        harness: RolloutHarness,
        engine: RolloutEngine,
        sampling: SamplingParams,
        hp: Any,
        *,
        eval_greedy: bool = True,
        eval_sampled: bool = True,
        num_samples_to_keep: int = 4,
        num_train_rows: int | None = None,
        eval_num_samples: int = 1,
    ) -> None:
        super().__init__()
        self.automatic_optimization = False
        # Checkpoints hold trainable weights only; the frozen base reloads from model.path.
        self.strict_loading = False
        self.policy = policy
        self.harness = harness
        self.engine = engine
        self.sampling = sampling
        self.hp = hp
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
        return self.rollout(rows, self.sampling, group_size=self.hp.group_size), {}

    def on_fit_start(self) -> None:
        self.objective = self.build_objective()

    def current_objective(self) -> Objective:
        """The objective built at fit start (or now, outside a fit)."""
        if self.objective is None:
            self.objective = self.build_objective()
        return self.objective

    def build_objective(self) -> Objective:
        """The micro-batch loss: Liger's fused kernel (GPU, ``algo.use_liger_loss``) or ours."""
        hp = self.hp
        tis_cap = hp.tis_cap if hp.old_logprobs_source == "trainer" else None
        self.use_liger = use_liger(hp, self.device)
        if self.use_liger:
            return LigerObjective(
                hp,
                temperature=self.sampling.temperature,
                chunk_rows=hp.chunk_rows,
                max_len=self.max_len_norm,
                tis_cap=tis_cap,
                world_size=self.world_size,
            )
        kl_term = None
        if hp.beta > 0 and hp.kl_mode == "loss":
            kl_term = KLTerm(hp.beta, hp.kl_estimator, hp.kl_clamp, hp.kl_importance_weighted)
        return PolicyObjective(
            self.policy_term(),
            agg_mode=hp.loss_agg_mode,
            max_len=self.max_len_norm,
            temperature=self.sampling.temperature,
            chunk_rows=hp.chunk_rows,
            kl_term=kl_term,
            entropy_coef=self.entropy_coef(),
            tis_cap=tis_cap,
            critic=self.critic_term(),
        )

    # ---------------------------------------------------------------- the training step
    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        t_start = time.perf_counter()
        with gathered(self.policy):  # FSDP: full weights, so ranks generate independently
            # 1. Rollout: group_size episodes per prompt row, sampled from the current policy.
            result, metrics = self.collect(batch.tolist())
            result = self.finalize_rewards(result)
            traj = result.batch.to(self.device)
            self.rollouts_done()
            self.report_phase("log-probs and advantages")
            t_rollout = time.perf_counter() - t_start
            # 2. Log-probs the update needs, once, without gradients.
            old_logp = self.old_logprobs(traj)  # None: on-policy, the update's own log-probs (detached)
            ref_logp = self.batched_logprobs(traj, reference=True) if self.hp.beta > 0 else None
            # 3. Score: rewards -> advantages; pick the tokens that count in the loss.
            scored = self.score(traj, old_logp, ref_logp)
            metrics.update(scored.metrics)
        # 4. Optimize: update_epochs x mini-batches, each accumulated over micro-batches.
        metrics.update(self.update(traj, scored, old_logp, ref_logp))
        # 5. Log.
        step_s = time.perf_counter() - t_start
        metrics.update(self.rollout_metrics(traj, result))
        metrics["perf/step_s"] = torch.tensor(step_s)
        metrics["perf/rollout_s"] = torch.tensor(t_rollout)
        metrics["perf/tokens_per_s"] = traj.action_mask.sum().float().cpu() / step_s
        self.log_step(metrics)
        self.log("reward", metrics["rollout/reward_mean"], prog_bar=True, logger=False)
        self.warn_on_engine_gap(metrics)
        self.keep_samples(result)

    def finalize_rewards(self, result: RolloutResult) -> RolloutResult:
        """The step's training rewards once its batch is final (after every refill round): the
        ``reward`` group's batch-normalised components standardised over every rank's batch."""
        reward = self.harness.reward
        if reward is None:
            return result
        metrics = reward.finalize(
            result.trajectories, lambda t: all_sum(t, self.world_size), device=self.device
        )
        batch = collate(result.trajectories, self.harness.tokenizer.pad_token_id)
        return RolloutResult(batch, result.trajectories, {**result.metrics, **metrics})

    def rollout_hooks(self) -> list[RolloutHooks]:
        """The trainer's callbacks that take this module's own hooks (:class:`RolloutHooks`)."""
        if self._trainer is None:
            return []
        return [
            cb for cb in cast(list, getattr(self.trainer, "callbacks", [])) if isinstance(cb, RolloutHooks)
        ]

    def report_phase(self, text: str) -> None:
        """Tell the hook callbacks (the progress bar) where the step is."""
        for cb in self.rollout_hooks():
            cb.on_phase(self.trainer, self, text)

    def rollouts_done(self) -> None:
        """Rollouts are collected: callbacks may put the engine to sleep before training."""
        for cb in self.rollout_hooks():
            cb.on_rollout_end(self.trainer, self)

    def is_on_policy(self, n: int) -> bool:
        """One epoch over one mini-batch: old log-probs equal the current ones (ratio 1)."""
        return self.hp.update_epochs == 1 and self.mini_batch_size(n) == n

    @property
    def rollout_batch_size(self) -> int:
        """Trajectories per training step on this rank (``prompts_per_step`` is global)."""
        return cast(int, self.per_rank(self.hp.prompts_per_step, "prompts_per_step")) * self.hp.group_size

    def mini_batch_size(self, n: int) -> int:
        """Trajectories per optimizer step on this rank (``algo.mini_batch_size`` is global)."""
        return min(self.per_rank(self.hp.mini_batch_size, "mini_batch_size") or n, n)

    def micro_batch_size(self, n: int) -> int:
        return min(self.per_rank(self.hp.micro_batch_size, "micro_batch_size") or n, n)

    def micro_chunks(
        self, index: torch.Tensor, lengths: list[int], n: int, extra: int = 0
    ) -> list[torch.Tensor]:
        """Rows ``index`` (of a mini-batch of ``n``) as micro-batches: packed within
        ``algo.micro_batch_tokens`` padded tokens (``lengths``: every row's sequence length, plus
        ``extra`` padding columns the pass adds), else ``micro_batch_size`` rows at a time."""
        if self.hp.micro_batch_tokens is not None:
            return split_by_tokens(index, [length + extra for length in lengths], self.hp.micro_batch_tokens)
        return split_rows(index, self.micro_batch_size(n))

    def row_lengths(self, traj: TrajectoryBatch) -> list[int]:
        """Every row's sequence length, read once per pass when micro-batches follow a token
        budget (one host sync), else nothing."""
        return traj.attention_mask.sum(-1).tolist() if self.hp.micro_batch_tokens is not None else []

    def old_logprobs(self, traj: TrajectoryBatch) -> torch.Tensor | None:
        """The behaviour log-probs the ratios use.

        ``old_logprobs_source=rollout``: the engine's sampling log-probs (no extra pass).
        ``trainer``: a no-grad pass, skipped when the update is on-policy and nothing before the
        update needs them (off-policy masking, KL in reward or advantages).
        """
        if self.hp.old_logprobs_source == "rollout":
            return traj.sampling_logps
        needed_before_update = (
            self.hp.offpolicy_token_bounds is not None
            or self.hp.offpolicy_seq_threshold is not None
            or (self.hp.beta > 0 and self.hp.kl_mode != "loss")
        )
        if self.is_on_policy(len(traj)) and not needed_before_update:
            return None
        return self.batched_logprobs(traj)

    def batched_logprobs(self, traj: TrajectoryBatch, reference: bool = False) -> torch.Tensor:
        """No-grad log-probs of every action token. Shape: (B, L-1)"""
        return self.batched_heads(traj, "logp", reference=reference)

    @torch.no_grad()
    def batched_heads(self, traj: TrajectoryBatch, head: str, reference: bool = False) -> torch.Tensor:
        """One no-grad head (``logp`` or ``value``) for the whole batch, micro-batch by micro-batch.

        Returns:
            Shape: (B, L-1)
        """
        out = torch.zeros(traj.action_mask.shape, device=self.device)
        rows = torch.arange(len(traj), device=self.device)
        for index in self.micro_chunks(rows, self.row_lengths(traj), len(traj)):
            value = self.policy.forward_heads(
                traj.select(index),
                (head,),
                temperature=self.sampling.temperature,
                chunk_rows=self.hp.chunk_rows,
                reference=reference,
            )[head]
            out[index, : value.shape[1]] = value.float()
        return out

    # ---------------------------------------------------------------- scoring
    def score(
        self, traj: TrajectoryBatch, old_logp: torch.Tensor | None, ref_logp: torch.Tensor | None
    ) -> Scored:
        """Shaped returns -> advantages, and the loss mask (action tokens that count): the
        :class:`~rlhf_lightning.algorithms.scoring.Scorer` of the current hyper-parameters
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
        sched = cast(LRScheduler, self.lr_schedulers())
        adv, loss_mask = scored.adv, scored.mask
        objective = self.objective_for(scored)
        n = len(traj)
        mini = self.mini_batch_size(n)
        lengths = self.row_lengths(traj)
        # Rows whose advantage is 0 everywhere add no gradient unless a KL loss term is used.
        seq_adv = (adv if adv.dim() == 1 else (adv * loss_mask).abs().sum(-1)) * loss_mask.any(-1)
        kl_in_loss = self.hp.beta > 0 and self.hp.kl_mode == "loss"
        skip_zero = not kl_in_loss and self.can_skip_zero_advantage()
        actor = self.actor_loss_enabled()
        # Every rank takes the same number of optimizer steps (a rank with fewer rows after
        # dynamic sampling runs empty mini-batches); micro-batch counts may differ freely.
        minis = agree_max(-(-n // mini), self.world_size, self.device)
        acc = MetricAccumulator()
        for epoch in range(self.hp.update_epochs):
            order = torch.randperm(n, device=self.device) if n > mini else torch.arange(n, device=self.device)
            batches = list(order.split(mini))
            batches += [order[:0]] * (minis - len(batches))
            for j, mb in enumerate(batches):
                self.report_phase(f"update {epoch * minis + j + 1}/{self.hp.update_epochs * minis}")
                # Normalisers of the whole mini-batch, global over ranks.
                norm = self.normalisers(loss_mask[mb], mb, scored)
                run = mb[seq_adv[mb] != 0] if skip_zero else mb
                mb_loss = torch.zeros((), device=self.device)
                mb_actor = torch.zeros((), device=self.device)
                for index, weight in self.lockstep(self.micro_chunks(run, lengths, mini)):
                    loss, m = self.micro_step(
                        traj, scored, old_logp, ref_logp, index, norm, objective, actor, weight
                    )
                    self.backward_(loss)
                    if not weight:
                        continue  # FSDP padding: same passes as the other ranks, no gradient
                    mb_loss = mb_loss + loss.detach()
                    mb_actor = mb_actor + m.pop("actor/loss_part", torch.zeros((), device=self.device))
                    acc.add(m, weight=loss_mask[index].sum())
                grad_metrics = self.optimizer_step_()
                acc.add({"actor/loss": mb_actor, "train/loss": mb_loss, **grad_metrics})
        out = acc.result()
        out["actor/lr"] = torch.tensor(sched.get_last_lr()[0])
        out["actor/skipped_rows_frac"] = (seq_adv == 0).float().mean() if skip_zero else torch.zeros(())
        return {k: v.detach().float().cpu() for k, v in out.items()}

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
        traj: TrajectoryBatch,
        scored: Scored,
        old_logp: torch.Tensor | None,
        ref_logp: torch.Tensor | None,
        index: torch.Tensor,
        norm: dict[str, Any],
        objective: Objective,
        actor: bool = True,
        weight: float = 1.0,
    ) -> tuple[torch.Tensor, Metrics]:
        """The loss of one micro-batch, already normalised for the whole mini-batch, times
        ``weight`` (0 for FSDP's padding micro-batches; a separate critic pass is scaled too)."""
        sub = traj.select(index)
        width = sub.action_mask.shape[1]
        adv = scored.adv
        mb = MicroBatch(
            sub=sub,
            index=index,
            adv=adv[index] if adv.dim() == 1 else adv[index][:, :width],
            mask=scored.mask[index][:, :width],
            old_logp=_rows(old_logp, index, width),
            ref_logp=_rows(ref_logp, index, width) if self.hp.kl_mode == "loss" else None,
            critic=scored.critic.rows(index, width) if scored.critic is not None else None,
        )
        if weight == 1.0:
            return objective(self.policy, mb, norm, self.backward_, actor)
        loss, m = objective(self.policy, mb, norm, lambda part: self.backward_(part * weight), actor)
        return loss * weight, m

    @property
    def max_len_norm(self) -> int:
        return self.hp.max_len_norm or self.sampling.max_new_tokens

    # ---------------------------------------------------------------- metrics and samples
    def rollout_metrics(self, traj: TrajectoryBatch, result: RolloutResult) -> Metrics:
        returns = traj.returns.float()
        out = {
            "rollout/reward_mean": returns.mean(),
            "rollout/reward_std": returns.std() if len(returns) > 1 else torch.zeros(()),
            "rollout/completion_len": traj.action_mask.sum(-1).float().mean(),
            # at most one token (an eos): what a collapsed policy produces
            "rollout/empty_frac": (traj.action_mask.sum(-1) <= 1).float().mean(),
        }
        out.update(turn_metrics(traj.turn_lengths, traj.rewards, traj.truncated))
        out.update({k: torch.tensor(v) for k, v in result.metrics.items()})
        return {k: v.detach().float().cpu() for k, v in out.items()}

    def warn_on_engine_gap(self, metrics: Metrics) -> None:
        """Warn (at most every 100 steps) when the engine and the trainer disagree noticeably."""
        gap, clip = metrics.get("is/gap_mean"), metrics.get("is/clip_frac")
        if gap is None or clip is None or self.global_step - self._warned_gap_at < 100:
            return
        if float(gap) > IS_GAP_WARN or float(clip) > IS_CLIP_WARN:
            self._warned_gap_at = self.global_step
            log.warning(
                "rollout engine and trainer log-probs differ: mean gap %.3f nats (warn > %.2f), "
                "%.1f%% of importance weights truncated at %s (warn > %.0f%%); check dtype and sampling settings",
                float(gap),
                IS_GAP_WARN,
                100 * float(clip),
                self.hp.tis_cap,
                100 * IS_CLIP_WARN,
            )

    def keep_samples(self, result: RolloutResult) -> None:
        self.last_samples = [
            {"prompt": t.prompt_text, "completion": t.completion_text, "reward": sum(t.rewards)}
            for t in result.trajectories[: self.num_samples_to_keep]
        ]

    # ---------------------------------------------------------------- optimisation
    def configure_optimizers(self) -> Any:
        return adamw_with_schedule(self.policy.trainable_parameters(), self.hp, self.total_optimizer_steps())

    def total_optimizer_steps(self) -> int:
        trainer = self._trainer
        if trainer is None:
            return 1
        if trainer.max_steps and trainer.max_steps > 0:
            return trainer.max_steps
        n = self.rollout_batch_size
        per_batch = self.hp.update_epochs * (n // self.mini_batch_size(n))
        return max(int(trainer.estimated_stepping_batches) * per_batch, 1)
