"""One learner state (:class:`Member`) and the schedule that says which members learn from a
step's rollouts (:class:`MemberSchedule`).

Without a population there is one member, the run's own settings (:class:`OneMember`). A
population's schedules (``population/``) hold several: side by side (every member learns every
step, each in its own adapters) or round-robin (one member a step, its weights swapped onto the
model). The learner takes the member as an argument; nothing about a member lives on the module.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from rlhf_lightning.config.algo import RolloutAlgoConfig
from rlhf_lightning.learner.optimizer import StepHealth
from rlhf_lightning.records.sampling import SamplingParams

Metrics = dict[str, torch.Tensor]


@dataclass
class Member:
    """What one learner state is.

    Args:
        hp: its algorithm config (the run's, with a population member's own values applied).
        sampling: its training sampling parameters (a member may have its own temperature).
        optimizer: its optimizer and schedule among the module's (None: the only one).
        adapter: its own adapter when members sit side by side (None: it trains in the slots).
        own_reference: its reference adapter moves on its own optimizer steps (side by side).
        health: its record of skipped non-finite steps (the guard's streak).
        state: its family's own counters (PPO: ``learn_steps``, which the critic warm-up reads).
        objectives: the objectives built for it, by their key (the learner's cache).
    """

    hp: RolloutAlgoConfig
    sampling: SamplingParams
    optimizer: int | None = None
    adapter: str | None = None
    own_reference: bool = False
    health: StepHealth = field(default_factory=StepHealth)
    state: dict[str, int] = field(default_factory=dict)
    objectives: dict[Any, Any] = field(default_factory=dict, repr=False)

    def set_hp(self, hp: RolloutAlgoConfig, sampling: SamplingParams) -> None:
        """New hyper-parameters (a population's mutation or a swap): the objective follows."""
        self.hp, self.sampling = hp, sampling
        self.objectives.clear()


@runtime_checkable
class MemberSchedule(Protocol):
    """Which members learn from a step's rollouts, and each one's weights in the trainable slots
    while it does. A callback that provides one is found by the module at ``setup``
    (:func:`schedule_of`)."""

    members: list[Member]
    side_by_side: bool  # every member learns every step, sampled in one engine call

    def learning_now(self) -> list[Member]:
        """The members that learn this step, in order (the same on every rank)."""
        ...

    def in_slots(self, member: Member) -> Any:
        """A context: ``member``'s weights in the trainable slots (copied back after)."""
        ...

    def rollouts(self, source: Any, rows: list[int]) -> tuple[list[tuple[Member, Any]], Metrics]:
        """This step's training rollouts of ``rows`` from ``source`` (the module's
        :class:`~rlhf_lightning.rollout.source.RolloutSource`) for each member that learns now,
        and the metrics of the rollout calls as a whole (``async/*``, refills, whole-call counts)."""
        ...


class OneMember:
    """The run without a population: one member, always in the slots."""

    side_by_side = False

    def __init__(self, member: Member) -> None:
        self.members = [member]

    def learning_now(self) -> list[Member]:
        return self.members

    @contextmanager
    def in_slots(self, member: Member) -> Iterator[None]:
        yield

    def rollouts(self, source: Any, rows: list[int]) -> tuple[list[tuple[Member, Any]], Metrics]:
        """The source's training rollouts (now, or from the async driver; GRPO's refills)."""
        member = self.learning_now()[0]
        result, metrics = source.collect(rows, member.sampling, member.hp.group_size)
        return [(member, result)], metrics


def schedule_of(callbacks: list[Any]) -> MemberSchedule | None:
    """The member schedule a trainer's callbacks provide (a population's), or None."""
    for cb in callbacks:
        schedule = getattr(cb, "member_schedule", None)
        if isinstance(schedule, MemberSchedule):
            return schedule
    return None
