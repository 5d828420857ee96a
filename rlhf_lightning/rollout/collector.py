"""The collector: a rollout module's training rollouts, step by step.

Synchronous (``rollout.mode=sync``): the step's episodes are generated now, by the module's
engine, with the current weights. Asynchronous: they come from the producer process
(:class:`~rlhf_lightning.rollout.async_rollout.AsyncRollouts`), or with ``rollout=vllm_server``
from the inference servers (:class:`~rlhf_lightning.rollout.server_async.ServerRollouts`),
generated ahead with the versions its staleness bound allows, for the rows of the train loader's
plan, which the collector hands them at the start of a fit; after each update the collector
publishes the new weights and the next batch is requested. The collector counts the steps done
(the policy version) and checkpoints what a resume needs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from rlhf_lightning.records.result import RolloutResult
from rlhf_lightning.records.sampling import SamplingParams
from rlhf_lightning.rollout.async_plan import BatchSource, RowPlan, is_stale

Metrics = dict[str, torch.Tensor]


class AsyncBatches(Protocol):
    """Asynchronous rollouts as the collector drives them: the producer process's
    (:class:`~rlhf_lightning.rollout.async_rollout.AsyncRollouts`) or the inference servers'
    (:class:`~rlhf_lightning.rollout.server_async.ServerRollouts`)."""

    def begin(
        self, step: int, plan: RowPlan, sampling: SamplingParams, group_size: int, source: BatchSource
    ) -> None: ...

    def rollout(self, step: int, rows: list[int]) -> tuple[RolloutResult, Metrics]: ...

    def updated(self, version: int, source: BatchSource) -> None: ...

    def state_dict(self, batches_done: int) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class Collector:
    """Training rollouts now or from the producer.

    Args:
        async_rollouts: the producer's (or the servers') trainer side (``rollout.mode=async``), or None.
    """

    def __init__(self, async_rollouts: AsyncBatches | None = None) -> None:
        self.async_rollouts = async_rollouts
        self.batches_done = 0  # training steps done: the current policy version

    def begin(self, plan: RowPlan, sampling: SamplingParams, group_size: int, source: BatchSource) -> None:
        """At a fit's start (after a checkpoint is restored): asynchronous rollouts start
        generating the batches from the current one on, for the rows ``plan`` gives each."""
        if self.async_rollouts is not None:
            self.async_rollouts.begin(self.batches_done, plan, sampling, group_size, source)

    def collect(
        self, rows: list[int], generate_now: Callable[[list[int]], RolloutResult]
    ) -> tuple[RolloutResult, Metrics]:
        """This step's episodes for ``rows``, and the producer's ``async/*`` metrics."""
        if self.async_rollouts is None:
            return generate_now(rows), {}
        return self.async_rollouts.rollout(self.batches_done, rows)

    def is_stale(self, result: RolloutResult) -> bool:
        """Whether ``result`` was generated with weights older than the current ones."""
        return is_stale(result, self.batches_done)

    def step_done(self, source: Callable[[], BatchSource]) -> None:
        """One more update: the new version goes to the producer with the next request."""
        self.batches_done += 1
        if self.async_rollouts is not None:
            self.async_rollouts.updated(self.batches_done, source())

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"batches_done": self.batches_done}
        if self.async_rollouts is not None:
            state["async"] = self.async_rollouts.state_dict(self.batches_done)
        return state

    def load_state_dict(self, state: dict[str, Any], batches_done: int) -> None:
        """``state`` from :meth:`state_dict` (``batches_done``: for a checkpoint without one)."""
        self.batches_done = state.get("batches_done", batches_done)
        if self.async_rollouts is not None:
            self.async_rollouts.load_state_dict(state.get("async", {}))

    def close(self) -> None:
        if self.async_rollouts is not None:
            self.async_rollouts.close()
