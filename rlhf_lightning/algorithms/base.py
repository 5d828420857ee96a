"""One training skeleton for every rollout algorithm.

    rows -> collect: rollouts for the members that learn this step (generated now with the
            current policy, or from the async producer), scored in the env
         -> for each member, the learner (``learner/learner.py``):
            score: no-grad behaviour / reference log-probs (only when needed) -> rewards ->
                   advantages; the tokens that count (truncation, off-policy masks)
            update: for epoch, mini-batch, micro-batch: loss -> backward -> clip -> step
         -> namespaced metrics (a population's: each member's and their mean)

A family is a :class:`~rlhf_lightning.learner.family.Family` (advantages, policy and critic
terms, parameter groups, its own counters) named by the module's ``family`` attribute. Which
members learn is a :class:`~rlhf_lightning.learner.member.MemberSchedule`: one member, or a
population's schedule (side by side, round-robin) that its callback provides.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar

import torch

from rlhf_lightning.algorithms.common import Metrics
from rlhf_lightning.algorithms.diagnostics import (
    mean_over_members,
    rollout_metrics,
    sample_rows,
    warn_on_engine_gap,
)
from rlhf_lightning.algorithms.evaluation import RolloutEvaluation
from rlhf_lightning.config.algo import RolloutAlgoConfig
from rlhf_lightning.data.resumable import ResumableLoader
from rlhf_lightning.learner.family import Family
from rlhf_lightning.learner.learner import Learner
from rlhf_lightning.learner.member import Member, MemberSchedule, OneMember, schedule_of
from rlhf_lightning.learner.optimizer import StepHealth, adamw_with_schedule, total_optimizer_steps
from rlhf_lightning.learner.scoring import finalize_rewards
from rlhf_lightning.models.policy import Policy
from rlhf_lightning.models.sharding import gathered
from rlhf_lightning.records.result import RolloutResult
from rlhf_lightning.records.sampling import SamplingParams
from rlhf_lightning.records.trajectory import Trajectory
from rlhf_lightning.rollout.asynchronous.driver import AsyncDriver
from rlhf_lightning.rollout.asynchronous.plan import BatchSource
from rlhf_lightning.rollout.engines.base import RolloutEngine
from rlhf_lightning.rollout.episodes.harness import RolloutHarness
from rlhf_lightning.rollout.hooks import hook_callbacks
from rlhf_lightning.rollout.source import Refill, RolloutSource


def actor_source(policy: Any, rank: int, world_size: int = 1, device: str = "cpu") -> BatchSource:
    """The producer's view of the trainer: ``rank``, a CPU copy of ``policy``'s actor weights
    (by the role the policy was built with), the number of ranks and the trainer's ``device``."""
    actor = policy.roles["actor"]

    def weights() -> dict[str, torch.Tensor]:
        return {n: p.detach().to("cpu", copy=True) for n, p in policy.named_parameters() if n in actor}

    return BatchSource(rank, weights, world_size, device)


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
        teacher: on-policy distillation's teacher (``algo.teacher``), or None.
    """

    generates_in_training_step = True
    family: ClassVar[type[Family]] = Family  # the family's strategy (a subclass names its own)
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
        driver: AsyncDriver | None = None,
        teacher: Any = None,
    ) -> None:
        super().__init__(policy, hp)
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
        # The last step's episodes (the first member's) and the policy version that sampled them
        # (turns without their own ``turn_versions``): what ``trace.every_n_steps`` writes.
        self.last_trajectories: list[Trajectory] = []
        self.last_rollout_version = 0
        self.last_eval_step = -1
        self._eval_outputs = {}
        self._warned_gap_at = -(10**9)
        # The episodes: training rollouts now or from the async driver, evaluation's now.
        self.source = RolloutSource(
            harness,
            engine,
            policy,
            version=lambda: int(self.global_step),
            device=lambda: self.device,
            progress=self.report_phase,
            driver=driver,
            refill=self.refill(),
        )
        self.learner = Learner(
            policy,
            self.family(),
            self.stepper,
            self.report_phase,
            lambda: int(self.global_step),
            teacher=teacher,
        )
        # Without a population: one member, the run's settings. A population's callback
        # provides its own schedule, taken at setup (before the optimizers are configured).
        self.schedule: MemberSchedule = OneMember(
            Member(hp, sampling, state=self.learner.family.initial_state())
        )

    def setup(self, stage: str) -> None:
        found = schedule_of(getattr(self._trainer, "callbacks", None) or [])
        if found is not None:
            self.schedule = found

    # ---------------------------------------------------------------- the training step
    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        t_start = time.perf_counter()
        version = int(self.global_step)  # the weights the rollouts below sample with
        with gathered(self.policy):  # FSDP: full weights, so ranks generate independently
            # 1. Rollouts for the members that learn this step (one engine call side by side).
            rollouts, metrics = self.schedule.rollouts(self.source, batch.tolist())
            self.rollouts_done()
        t_rollout = time.perf_counter() - t_start
        # 2. Each member learns from its own episodes: score, then update.
        learned = [
            self.learn(k, member, result, len(rollouts)) for k, (member, result) in enumerate(rollouts)
        ]
        # The step is done: with rollout.mode=async the new weights go to the producer.
        self.source.step_done(self.producer_view)
        # 3. Log: one member's metrics, or each member's under member_k/ and their mean.
        step_s = time.perf_counter() - t_start
        each = [m for m, _ in learned]
        shown = each[0] if len(each) == 1 else mean_over_members(each)
        if len(each) > 1:
            shown.update({f"member_{k}/{key}": v for k, m in enumerate(each) for key, v in m.items()})
            shown["population/member_updates"] = torch.tensor(float(self.global_step))
        shown.update(metrics)  # the rollout call's own (async/*, refills, whole-call counts)
        tokens = sum(tokens for _, tokens in learned)
        shown["perf/step_s"] = torch.tensor(step_s)
        shown["perf/rollout_s"] = torch.tensor(t_rollout)
        shown["perf/tokens_per_s"] = torch.as_tensor(tokens).float().cpu() / step_s
        self.log_step(shown)
        self.log("reward", shown["rollout/reward_mean"], prog_bar=True, logger=False)
        if self.global_step - self._warned_gap_at >= 100 and warn_on_engine_gap(shown, self.hp.tis_cap):
            self._warned_gap_at = self.global_step  # at most every 100 steps
        self.last_samples = sample_rows(rollouts[0][1].trajectories[: self.num_samples_to_keep])
        self.last_trajectories, self.last_rollout_version = rollouts[0][1].trajectories, version

    def learn(
        self, k: int, member: Member, result: RolloutResult, count: int
    ) -> tuple[Metrics, torch.Tensor]:
        """Member ``k`` (of ``count``) learns from ``result``, its weights in the trainable slots:
        the batch's final rewards, scored, then the update. Returns its metrics and the number
        of action tokens it trained on."""
        with self.schedule.in_slots(member):
            self.report_phase("log-probs and advantages" if count == 1 else f"member {k + 1}/{count}")
            with gathered(self.policy):
                result = self.finalize_rewards(result)
                traj = result.batch.to(self.device)
                scored = self.learner.score(traj, member, self.source.is_stale(result))
            metrics = {**scored.metrics, **self.learner.update(traj, scored, member)}
        metrics.update(rollout_metrics(traj, result.metrics))
        return metrics, traj.action_mask.sum()

    def refill(self) -> Refill | None:
        """Dynamic sampling's refills of the training rollouts (GRPO's), or None."""
        return None

    def on_train_start(self) -> None:
        """Asynchronous rollouts start here, after a checkpoint is restored and before the first
        step: they are handed the train loader's plan of rows, the sampling and group size of the
        member that learns (a population is refused with ``rollout.mode=async``)."""
        super().on_train_start()
        if self.source.driver is None:
            return
        loader = self.trainer.train_dataloader
        if not isinstance(loader, ResumableLoader):
            raise TypeError(
                f"rollout.mode=async generates ahead for the rows of the run's ResumableLoader; the train "
                f"loader is a {type(loader).__name__}: use the env's prompts data module, or rollout.mode=sync"
            )
        member = self.schedule.learning_now()[0]
        self.source.begin(loader.plan, member.sampling, member.hp.group_size, self.producer_view())

    def producer_view(self) -> BatchSource:
        """What the producer needs of this trainer (``rollout.mode=async``): :func:`actor_source`."""
        return actor_source(self.policy, self.rank, self.world_size, str(self.device))

    def finalize_rewards(self, result: RolloutResult) -> RolloutResult:
        """The step's training rewards once its batch is final (after every refill round): the
        ``reward`` group's batch-normalised components standardised over every rank's batch."""
        return finalize_rewards(
            result, self.harness.reward, self.harness.tokenizer.pad_token_id, self.world_size, self.device
        )

    def report_phase(self, text: str) -> None:
        """Tell the hook callbacks (the progress bar) where the step is."""
        for cb in hook_callbacks(self.trainer if self._trainer is not None else None):
            cb.on_phase(self.trainer, self, text)

    def rollouts_done(self) -> None:
        """Rollouts are collected: callbacks may put the engine to sleep before training."""
        for cb in hook_callbacks(self.trainer if self._trainer is not None else None):
            cb.on_rollout_end(self.trainer, self)

    # ---------------------------------------------------------------- state and workers
    def guard_records(self) -> list[StepHealth]:
        return [m.health for m in self.schedule.members]

    def checkpoint_keys(self) -> set[str]:
        """The trainable slots, the reference, and a population's members side by side."""
        members = {f"policy.{n}" for n, _ in self.policy.named_parameters() if ".member_" in f".{n}"}
        return super().checkpoint_keys() | members

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["collector"] = self.source.state_dict()
        checkpoint["member_states"] = [dict(m.state) for m in self.schedule.members]

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        steps = checkpoint.get("global_step", 0) // max(self.steps_per_batch(), 1)
        self.source.load_state_dict(checkpoint.get("collector", {}), steps)
        for m, state in zip(self.schedule.members, checkpoint.get("member_states", [])):
            m.state = dict(state)

    def close(self) -> None:
        """Stop the rollout producer (``rollout.mode=async``) and the env's workers; the run
        calls this at its end."""
        self.source.close()
        super().close()

    def teardown(self, stage: str) -> None:
        self.close()

    # ---------------------------------------------------------------- optimisation
    def configure_optimizers(self) -> Any:
        """One AdamW and schedule per member of the schedule; members side by side split the
        run's optimizer steps (each schedule spans its member's own)."""
        members = self.schedule.members
        total = self.total_optimizer_steps()
        own = max(total // len(members), 1) if self.schedule.side_by_side else total
        opts = [
            adamw_with_schedule(self.learner.family.param_groups(self.policy, m.hp), m.hp, own)
            for m in members
        ]
        return opts[0] if len(opts) == 1 else opts

    def steps_per_batch(self) -> int:
        """Optimizer steps one training step takes (every member's, side by side)."""
        per = self.learner.plan(Member(self.hp, self.sampling)).optimizer_steps_per_batch()
        return per * (len(self.schedule.members) if self.schedule.side_by_side else 1)

    def total_optimizer_steps(self) -> int:
        return total_optimizer_steps(self._trainer, self.steps_per_batch())
