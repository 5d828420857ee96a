"""The resident member of a population: the one whose state is on the model.

Its weights sit in the policy's adapter slots (and its own reference adapter, when the reference
moves), its optimizer and scheduler state in Lightning's, its hyper-parameters, sampling and
counters in the one :class:`~rlhf_lightning.learner.member.Member` of the population's schedule
(which the module learns with). :class:`ResidentMember` swaps members in and out (copies);
:class:`~rlhf_lightning.population.callback.Population` mixes it in.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, cast

import torch

from rlhf_lightning.config.algo import RolloutAlgoConfig, with_hparams
from rlhf_lightning.learner.member import OneMember
from rlhf_lightning.learner.optimizer import set_base_lrs
from rlhf_lightning.population.members import Member, copy_into, follow_schedule


class ResidentMember:
    """Moves members' state on and off the model: :meth:`capture`, :meth:`store`, :meth:`load`.

    The attributes below are set by ``Population.__init__`` and ``on_fit_start``."""

    module: Any
    member_schedule: OneMember | None  # the resident's learner state (the module takes it at setup)
    members: list[Member]
    resident: int | None  # the slot whose state is on the model
    _base_hp: RolloutAlgoConfig
    _base_temperature: float
    _ref_interval: int | None  # members' own references move every this many updates
    _own_steps: int  # each member's schedule spans this many of its own optimizer steps

    def params(self) -> list[torch.nn.Parameter]:
        return cast(list[torch.nn.Parameter], self.module.policy.trainable_parameters())

    def optimizer(self) -> torch.optim.Optimizer:
        opt = self.module.optimizers()
        return cast(torch.optim.Optimizer, getattr(opt, "optimizer", opt))

    def scheduler(self) -> Any:
        return self.module.lr_schedulers()

    def reference_params(self) -> list[torch.nn.Parameter]:
        """The reference adapter's weights when it moves (each member has its own); else none."""
        policy = self.module.policy
        name = policy.reference_adapter if self._ref_interval else None
        return [] if name is None else [p for n, p in policy.named_parameters() if f".{name}." in n]

    @property
    def learner_member(self) -> Any:
        assert self.member_schedule is not None, "the population is set up at the fit's setup"
        return self.member_schedule.members[0]

    def counters(self) -> dict[str, int]:
        """The resident's own counters (PPO's ``learn_steps``)."""
        return dict(self.learner_member.state)

    def capture(self, member_id: int, hparams: dict[str, float], parent: int | None = None) -> Member:
        """The resident state as a new member (copies)."""
        return Member(
            member_id,
            dict(hparams),
            [p.detach().clone() for p in self.params()],
            copy.deepcopy(self.optimizer().state_dict()),
            copy.deepcopy(self.scheduler().state_dict()),
            parent=parent,
            reference=[p.detach().clone() for p in self.reference_params()],
            counters=self.counters(),
        )

    def store(self) -> None:
        """Copy the resident's state back into its member (after it trained)."""
        if self.resident is None:
            return
        m = self.members[self.resident]
        copy_into(m.weights, self.params())
        copy_into(m.reference, self.reference_params())
        m.optimizer = copy.deepcopy(self.optimizer().state_dict())
        m.scheduler = copy.deepcopy(self.scheduler().state_dict())
        m.counters = self.counters()

    def load(self, slot: int) -> None:
        """Make ``slot`` resident: weights, reference, optimizer and scheduler state, counters,
        hyper-parameters."""
        if self.resident == slot:
            return
        self.store()
        m = self.members[slot]
        copy_into(self.params(), m.weights)
        copy_into(self.reference_params(), m.reference)
        self.optimizer().load_state_dict(m.optimizer)
        sched = self.scheduler()
        sched.load_state_dict(m.scheduler)
        self.apply_hparams(m.hparams, m.counters)
        self.resident = slot
        if self.module.engine is not None:
            self.module.engine.invalidate()  # another member's weights: the engine syncs before sampling

    def apply_hparams(self, hp: dict[str, float], counters: dict[str, int] | None = None) -> None:
        """The resident's learning rates, hyper-parameters, sampling and ``counters`` (kept when
        None or empty): its learner state, which the module learns with."""
        module = self.module
        values: dict[str, Any] = dict(hp)
        if self._ref_interval:  # the population refreshes each member's own reference (refresh_reference)
            values["ref_update_interval"] = None
        sampling = dataclasses.replace(
            module.sampling, temperature=hp.get("temperature", self._base_temperature)
        )
        sched, opt = self.scheduler(), self.optimizer()
        member_hp = with_hparams(self._base_hp, values)
        follow_schedule(sched, member_hp, self._own_steps)  # its own min_lr_ratio
        lrs = [hp.get("lr", self._base_hp.lr)] * len(opt.param_groups)
        critic_lr = getattr(self._base_hp, "lr_critic", None)
        if critic_lr is not None and len(lrs) > 1:
            lrs[1] = critic_lr  # PPO's critic keeps its own configured lr
        set_base_lrs(opt, sched, lrs)
        member = self.learner_member
        member.set_hp(member_hp, sampling)
        if counters:
            member.state = dict(counters)

    def refresh_reference(self) -> None:
        """Copy the resident's actor onto its own reference after every ``ref_update_interval``-th
        update of that member (its scheduler's count: its own optimizer steps, a clone's counted
        on from its parent's). Called before each optimizer step and at each batch end: the
        actor is then as that count left it, so a repeated call copies the same weights."""
        if not self._ref_interval or self.resident is None:
            return
        done = self.scheduler().last_epoch
        if done > 0 and done % self._ref_interval == 0:
            self.module.policy.copy_actor_to_reference()
