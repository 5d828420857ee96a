"""Where a rollout module's episodes come from: one :class:`RolloutSource`, built once with the
module and handed to its member schedule.

Training rollouts (:meth:`RolloutSource.collect`) are generated now by the episode driver with
the current weights (``rollout.mode=sync``), or taken from the asynchronous driver
(:class:`~rlhf_lightning.rollout.asynchronous.driver.AsyncDriver`, ``rollout.mode=async``),
generated ahead with the versions its staleness bound allows for the rows of the train loader's
plan (handed over by :meth:`RolloutSource.begin` at the start of a fit). With DAPO's dynamic
sampling (:class:`Refill`) groups whose rewards are all equal are replaced by groups of freshly
drawn prompts, generated now. Evaluation and a population's side-by-side calls generate now
(:meth:`RolloutSource.generate`). The source counts the updates done (the policy version) and
checkpoints what a resume needs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rlhf_lightning.losses.advantages import informative_groups
from rlhf_lightning.models.sharding import gathered
from rlhf_lightning.records.result import RolloutResult
from rlhf_lightning.records.sampling import SamplingParams
from rlhf_lightning.records.trajectory import Trajectory, collate
from rlhf_lightning.rollout.asynchronous.driver import AsyncDriver
from rlhf_lightning.rollout.asynchronous.plan import BatchSource, RowPlan, is_stale

Metrics = dict[str, torch.Tensor]


@dataclass
class Refill:
    """DAPO's dynamic sampling (``algo.dynamic_sampling``): up to ``max_rounds`` rounds of
    ``generator``-drawn rows out of ``num_rows`` (the train split) replace the groups without
    signal."""

    max_rounds: int
    num_rows: int
    generator: torch.Generator


def informative(result: RolloutResult) -> list[list[Trajectory]]:
    """The groups of ``result`` whose rewards are not all equal."""
    keep = informative_groups(result.batch.returns, result.batch.group_ids).tolist()
    groups: dict[int, list[Trajectory]] = {}
    for t, k in zip(result.trajectories, keep):
        if k:
            groups.setdefault(t.group_id, []).append(t)
    return list(groups.values())


class RolloutSource:
    """The episodes of a rollout module.

    Args:
        harness: the episode driver (:class:`~rlhf_lightning.rollout.episodes.harness.RolloutHarness`).
        engine: the rollout engine (synced with ``policy`` before every call made now).
        policy: the trainable policy.
        version: the policy's current version for the engine's sync (the optimizer step).
        device: where the trajectory batches go.
        progress: hears where a training rollout is (the progress bar), or None.
        driver: the asynchronous driver (``rollout.mode=async``), or None.
        refill: dynamic sampling's settings, or None.
    """

    def __init__(
        self,
        harness: Any,
        engine: Any,
        policy: Any,
        *,
        version: Callable[[], int] = lambda: 0,
        device: Callable[[], Any] = lambda: "cpu",
        progress: Callable[[str], None] | None = None,
        driver: AsyncDriver | None = None,
        refill: Refill | None = None,
    ) -> None:
        self.harness, self.engine, self.policy = harness, engine, policy
        self.version, self.device, self.progress = version, device, progress
        self.driver, self.refill = driver, refill
        self.batches_done = 0  # training steps done: the policy version of the async plan

    @property
    def pad_token_id(self) -> int:
        return int(self.harness.tokenizer.pad_token_id)

    # ---------------------------------------------------------------- episodes
    def generate(
        self,
        rows: list[int],
        params: SamplingParams,
        *,
        group_size: int,
        evaluation: bool = False,
        adapters: list[str] | None = None,
        group_sizes: list[int] | None = None,
    ) -> RolloutResult:
        """Episodes for ``rows`` now, with the current policy: the engine is synced first (a
        no-op when nothing changed), so no rollout ever samples stale weights. ``adapters`` and
        ``group_sizes`` (one per row): a population's members sampled side by side."""
        if self.harness is None or self.engine is None:
            raise RuntimeError("rollouts need a harness and an engine")
        with gathered(self.policy):  # FSDP: ranks generate independently (free when nested)
            self.engine.ensure_synced(self.policy, self.version())
            return self.harness.rollout(
                self.engine,
                rows,
                params,
                group_size=group_size,
                evaluation=evaluation,
                progress=None if evaluation else self.progress,
                device=self.device(),
                adapters=adapters,
                group_sizes=group_sizes,
            )

    def collect(
        self, rows: list[int], sampling: SamplingParams, group_size: int
    ) -> tuple[RolloutResult, Metrics]:
        """This step's training episodes for ``rows``: now, or the asynchronous driver's batch
        (with its ``async/*`` metrics); then dynamic sampling's refills, now."""
        metrics: Metrics = {}
        if self.driver is None:
            result = self.generate(rows, sampling, group_size=group_size)
        else:
            result, metrics = self.driver.rollout(self.batches_done, rows)
        if self.refill is None:
            return result, metrics
        return self.refilled(result, len(rows), sampling, group_size, metrics)

    def refilled(
        self, result: RolloutResult, target: int, sampling: SamplingParams, group_size: int, first: Metrics
    ) -> tuple[RolloutResult, Metrics]:
        """``result`` with its groups without signal replaced by new ones (up to ``target``)."""
        assert self.refill is not None
        kept = informative(result)
        dropped = len(result.trajectories) // group_size - len(kept)
        rounds = 0
        while len(kept) < target and rounds < self.refill.max_rounds and self.refill.num_rows:
            extra = torch.randint(
                self.refill.num_rows, (target - len(kept),), generator=self.refill.generator
            ).tolist()
            new = informative(self.generate(extra, sampling, group_size=group_size))
            dropped += len(extra) - len(new)
            kept += new
            rounds += 1
        metrics = {
            **first,
            "rollout/dropped_groups": torch.tensor(float(dropped)),
            "rollout/resample_rounds": torch.tensor(float(rounds)),
            "rollout/informative_groups": torch.tensor(float(min(len(kept), target))),
        }
        if not kept:  # nothing to learn from: keep the batch (all advantages are 0)
            return result, metrics
        trajectories = []
        for g, group in enumerate(kept[:target]):
            for t in group:
                t.group_id = g
                trajectories.append(t)
        batch = collate(trajectories, self.pad_token_id)
        return RolloutResult(batch, trajectories, result.metrics), metrics

    # ---------------------------------------------------------------- versions
    def begin(self, plan: RowPlan, sampling: SamplingParams, group_size: int, source: BatchSource) -> None:
        """At a fit's start (after a checkpoint is restored): the asynchronous driver starts
        generating the batches from the current one on, for the rows ``plan`` gives each."""
        if self.driver is not None:
            self.driver.begin(self.batches_done, plan, sampling, group_size, source)

    def is_stale(self, result: RolloutResult) -> bool:
        """Whether ``result`` was generated with weights older than the current ones."""
        return is_stale(result, self.batches_done)

    def step_done(self, source: Callable[[], BatchSource]) -> None:
        """One more update: the new version goes to the asynchronous driver."""
        self.batches_done += 1
        if self.driver is not None:
            self.driver.updated(self.batches_done, source())

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"batches_done": self.batches_done}
        if self.driver is not None:
            state["async"] = self.driver.state_dict(self.batches_done)
        return state

    def load_state_dict(self, state: dict[str, Any], batches_done: int) -> None:
        """``state`` from :meth:`state_dict` (``batches_done``: for a checkpoint without one)."""
        self.batches_done = state.get("batches_done", batches_done)
        if self.driver is not None:
            self.driver.load_state_dict(state.get("async", {}))

    def close(self) -> None:
        if self.driver is not None:
            self.driver.close()
