"""A population's members side by side on one frozen base, owned by the module.

Member ``k`` is the named LoRA adapter ``member_k`` (its actor; with a moving reference also
``member_k_ref``; PPO's critic ``member_k_critic`` and a value head of its own), its own AdamW and schedule (Lightning's optimizer and scheduler ``k``) and its
own hyper-parameters. The engines sample every member's adapter in one call; each member then
updates on its own rows in the trainable slots (the ``actor`` adapter, ``reference``, ``critic``
and the value head), where
:meth:`MemberAPI.use_member` copies its adapters in and, after its update, back out (a LoRA
adapter's weights: a few megabytes at most). Nothing outside the module writes its attributes:
the population callback calls :class:`MemberAPI`'s methods (scoring, cloning, mutation).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import torch
from peft import PeftModel

from rlhf_lightning.config.algo import RolloutAlgoConfig, with_hparams
from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.learner.optimizer import (
    StepHealth,
    adamw_with_schedule,
    refresh_reference,
    set_base_lrs,
)
from rlhf_lightning.models.adapters import copy_adapter


def member_adapter(k: int) -> str:
    return f"member_{k}"


def member_reference(k: int) -> str:
    return f"member_{k}_ref"


def member_critic(k: int) -> str:
    return f"member_{k}_critic"


# (hyper-parameters, the algorithm's config values, world size, member id) -> raises if invalid
MemberCheck = Callable[[dict[str, float], dict[str, Any], int, int], None]


@dataclass
class MemberBank:
    """The members' hyper-parameters (plain values: ``algo.<name>``, and ``temperature``), whether
    each member has a reference of its own (``algo.ref_update_interval``), and which member's
    adapters are in the trainable slots now (None: none is)."""

    hparams: list[dict[str, float]]
    own_reference: bool
    active: int | None = None

    @property
    def size(self) -> int:
        return len(self.hparams)

    @property
    def adapters(self) -> list[str]:
        return [member_adapter(k) for k in range(self.size)]


class MemberAPI:
    """The module's members (mixed into :class:`~rlhf_lightning.algorithms.base.RolloutModule`).

    :meth:`enable_members` once, before the optimizers are configured (the population callback's
    ``setup``); then :meth:`use_member` around one member's update, :meth:`member_state` /
    :meth:`load_member_state` to copy a member (cloning, snapshots), :meth:`set_member_hparams`
    to mutate one (checked like a start-up value)."""

    policy: Any
    hp: RolloutAlgoConfig
    sampling: Any
    objective: Any
    world_size: int
    members: MemberBank | None = None
    member_value_heads: torch.nn.ModuleList
    _check_member: MemberCheck

    # ---------------------------------------------------------------- set-up
    def enable_members(self, hparams: list[dict[str, float]], check: MemberCheck) -> None:
        """Add one adapter set per member on the base, each a copy of the trainable slots as they
        are now (the actor; the reference when it moves; PPO's critic and value head); the
        members' optimizers come from
        :meth:`member_optimizers`. Only LoRA policies: members share the frozen base.

        ``check(hparams, algo, world_size, member_id)`` raises on a value that could not train
        (the population's start-up rules); every member's values pass it, at start and at every
        :meth:`set_member_hparams`."""
        model = self.policy.model
        if not isinstance(model, PeftModel) or self.policy.adapter_name is None:
            raise ValueError("members side by side need a LoRA policy (model.finetune=lora)")
        own_ref = bool(getattr(self.hp, "ref_update_interval", None))
        self.members = MemberBank([dict(h) for h in hparams], own_ref)
        for k in range(len(hparams)):
            for name, src in self._slots(k):
                if name not in model.peft_config:
                    with torch.random.fork_rng(devices=[]):  # its init draws nothing from training's streams
                        model.add_adapter(name, model.peft_config[src])
                with torch.no_grad():
                    copy_adapter(model, src, name)
        model.set_adapter(self.policy.adapter_name)  # add_adapter may move the active one
        head = self.policy.value_head
        if head is not None:  # PPO: each member's value head beside its critic adapter
            self.member_value_heads = torch.nn.ModuleList(copy.deepcopy(head) for _ in hparams)
            self.member_value_heads.requires_grad_(False)
        for n, p in self.policy.named_parameters():  # members train only in the trainable slots
            if ".member_" in n:
                p.requires_grad_(False)
        self._base_hp = self.hp
        self._base_sampling = self.sampling
        self._check_member = check
        self._objectives: dict[tuple[Any, ...], Any] = {}
        for k, h in enumerate(hparams):
            self.check_member_hparams(h, k)

    def member_optimizers(self, total_steps: int) -> list[dict[str, Any]]:
        """One AdamW and schedule per member over the trainable slots (each holds its member's
        moments); each schedule spans ``total_steps`` (its member's own optimizer steps)."""
        bank = cast(MemberBank, self.members)
        module = cast(Any, self)
        return [
            adamw_with_schedule(module.param_groups(self.member_hp(k)), self.member_hp(k), total_steps)
            for k in range(bank.size)
        ]

    def check_population_steps(self) -> None:
        """``trainer.max_steps`` counts member updates (optimizer steps): a whole number of
        population steps, so that every member takes the same number."""
        module = cast(Any, self)
        bank = cast(MemberBank, self.members)
        per, max_steps = module.steps_per_batch(), module.trainer.max_steps
        if max_steps and max_steps > 0 and max_steps % per:
            raise ConfigError(
                "trainer.max_steps",
                max_steps,
                f"it counts member updates: each population step takes {per} ({bank.size} members x "
                f"{per // bank.size} optimizer steps); set a multiple of {per}",
            )

    def member_checkpoint_keys(self) -> set[str]:
        """The members' adapters (and value heads), for the checkpoint (beside the trainable slots)."""
        keys = {f"policy.{n}" for n, _ in self.policy.named_parameters() if ".member_" in n}
        heads = getattr(self, "member_value_heads", None)
        return keys | (
            {f"member_value_heads.{n}" for n, _ in heads.named_parameters()} if heads is not None else set()
        )

    # ---------------------------------------------------------------- hyper-parameters
    def member_hp(self, k: int) -> Any:
        """Member ``k``'s algorithm config: the run's, with its own values (the reference refresh
        is the member's own, see :meth:`refresh_member_reference`)."""
        return with_hparams(self._base_hp, cast(MemberBank, self.members).hparams[k])

    def member_sampling(self, k: int) -> Any:
        t = cast(MemberBank, self.members).hparams[k].get("temperature", self._base_sampling.temperature)
        return dataclasses.replace(self._base_sampling, temperature=t)

    def check_member_hparams(self, hparams: dict[str, float], member_id: int) -> None:
        """Every value checked like a start-up value (bounds, integers, the batch geometry)."""
        self._check_member(hparams, dataclasses.asdict(self._base_hp), self.world_size, member_id)

    def set_member_hparams(self, k: int, hparams: dict[str, float], member_id: int | None = None) -> None:
        """Give member ``k`` these hyper-parameters (checked first); its optimizer's learning rate
        follows at once, its schedule's position kept."""
        self.check_member_hparams(hparams, k if member_id is None else member_id)
        bank = cast(MemberBank, self.members)
        bank.hparams[k] = dict(hparams)
        opt, sched = self.member_optimizer(k), self.member_scheduler(k)
        hp = self.member_hp(k)
        set_base_lrs(opt, sched, [group.get("lr", hp.lr) for group in cast(Any, self).param_groups(hp)])

    # ---------------------------------------------------------------- optimizers
    def optimizer_index(self) -> int | None:
        """The member in the slots steps its own optimizer (``ModuleMixin.current_optimizer``)."""
        return None if self.members is None else self.members.active

    def member_optimizer(self, k: int) -> torch.optim.Optimizer:
        opts = cast(Any, self).optimizers()
        opt = opts[k] if isinstance(opts, list) else opts
        return cast(torch.optim.Optimizer, getattr(opt, "optimizer", opt))

    def member_scheduler(self, k: int) -> Any:
        scheds = cast(Any, self).lr_schedulers()
        return scheds[k] if isinstance(scheds, list) else scheds

    # ---------------------------------------------------------------- one member in the slots
    def _pairs(self, k: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Member ``k``'s weights and the trainable slots' matching ones, found once."""
        cache: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = self.__dict__.setdefault(
            "_pair_cache", {}
        )
        if k not in cache:
            mine = self._member_params(k)
            slots = self._keyed([slot for _, slot in self._slots(k)], self.policy.value_head)
            cache[k] = (list(mine.values()), [slots[n] for n in mine])
        return cache[k]

    def _slots(self, k: int) -> list[tuple[str, str]]:
        """(member's adapter, trainable slot) pairs of member ``k``: actor, own reference, critic."""
        pairs = [(member_adapter(k), cast(str, self.policy.adapter_name))]
        if cast(MemberBank, self.members).own_reference:
            pairs.append((member_reference(k), cast(str, self.policy.reference_adapter)))
        if self.policy.critic_adapter is not None:
            pairs.append((member_critic(k), cast(str, self.policy.critic_adapter)))
        return pairs

    @contextmanager
    def use_member(self, k: int, train: bool = True) -> Iterator[None]:
        """Member ``k`` in the trainable slots, with its hyper-parameters, sampling, objective,
        optimizer and schedule; with ``train``, its adapters are copied back afterwards."""
        bank = cast(MemberBank, self.members)
        self.show_member(k)
        self.hp, self.sampling = self.member_hp(k), self.member_sampling(k)
        key = tuple(sorted(bank.hparams[k].items()))
        if key not in self._objectives:
            self._objectives[key] = cast(Any, self).build_objective()
        self.objective = self._objectives[key]
        try:
            yield
        finally:
            self.hp, self.sampling = self._base_hp, self._base_sampling
            if train:
                mine, slots = self._pairs(k)
                with torch.no_grad():
                    torch._foreach_copy_(mine, slots)

    def show_member(self, k: int) -> None:
        """Copy member ``k``'s adapters into the trainable slots (evaluation, export)."""
        bank = cast(MemberBank, self.members)
        mine, slots = self._pairs(k)
        with torch.no_grad():
            torch._foreach_copy_(slots, mine)
        bank.active = k
        engine = getattr(self, "engine", None)
        if engine is not None:  # vLLM's actor slot syncs again before it samples
            engine.invalidate()

    def refresh_member_reference(self) -> None:
        """The active member's reference follows its actor every ``ref_update_interval`` of its
        own optimizer steps (its schedule's count)."""
        bank = cast(MemberBank, self.members)
        if bank.own_reference and bank.active is not None:
            done = self.member_scheduler(bank.active).last_epoch
            refresh_reference(self.policy, self._base_hp.ref_update_interval, done)

    # ---------------------------------------------------------------- copies of members
    def _keyed(self, adapters: list[str], head: torch.nn.Module | None) -> dict[str, torch.nn.Parameter]:
        """The weights of ``adapters`` keyed by position and name without the adapter's own
        (``"0:...lora_A.{}.weight"``), and ``head``'s (``"value_head:weight"``): any member's keys
        match any other's and the trainable slots'."""
        out = {}
        for n, p in self.policy.model.named_parameters():
            for i, name in enumerate(adapters):
                if f".{name}." in n:
                    out[f"{i}:{n.replace(f'.{name}.', '.{}.')}"] = p
        if head is not None:
            out.update({f"value_head:{n}": p for n, p in head.named_parameters()})
        return out

    def _member_params(self, k: int) -> dict[str, torch.nn.Parameter]:
        """Member ``k``'s weights (:meth:`_keyed`), so any member's state loads into any other's."""
        head = self.member_value_heads[k] if self.policy.value_head is not None else None
        return self._keyed([member for member, _ in self._slots(k)], head)

    def member_weights(self, k: int) -> dict[str, torch.Tensor]:
        """Member ``k``'s weights by name, detached but not copied: to read, never to keep."""
        return {n: p.detach() for n, p in self._member_params(k).items()}

    def member_health(self, k: int) -> StepHealth:
        """Member ``k``'s record of skipped non-finite steps (its own streak for the guard)."""
        healths: list[StepHealth] = cast(Any, self).healths
        while len(healths) <= k:
            healths.append(StepHealth())
        return healths[k]

    def member_state(self, k: int) -> dict[str, Any]:
        """Copies of everything member ``k`` is: its adapters' weights, its optimizer's and
        schedule's state, its hyper-parameters and its guard record."""
        return {
            "weights": {n: w.clone() for n, w in self.member_weights(k).items()},
            "optimizer": copy.deepcopy(self.member_optimizer(k).state_dict()),
            "scheduler": copy.deepcopy(self.member_scheduler(k).state_dict()),
            "hparams": dict(cast(MemberBank, self.members).hparams[k]),
            "health": self.member_health(k).state_dict(),
        }

    def load_member_state(self, k: int, state: dict[str, Any]) -> None:
        """Make member ``k`` the member ``state`` describes (from :meth:`member_state` of any
        member): weights copied into its adapters in place, optimizer and schedule loaded."""
        params = self._member_params(k)
        if set(params) != set(state["weights"]):
            raise ValueError(f"member state does not fit member {k}'s adapters")
        with torch.no_grad():
            for n, w in state["weights"].items():
                params[n].copy_(w)
        self.member_optimizer(k).load_state_dict(copy.deepcopy(state["optimizer"]))  # nothing shared
        self.member_scheduler(k).load_state_dict(copy.deepcopy(state["scheduler"]))
        self.member_health(k).load_state_dict(state.get("health", {}))
        self.set_member_hparams(k, state["hparams"])
        bank = cast(MemberBank, self.members)
        if bank.active == k:
            bank.active = None  # the slots hold what member k was

    def member_checkpoint(self) -> dict[str, Any]:
        bank = cast(MemberBank, self.members)
        return {"hparams": [dict(h) for h in bank.hparams]}

    def load_member_checkpoint(self, state: dict[str, Any]) -> None:
        bank = cast(MemberBank, self.members)
        bank.hparams = [dict(h) for h in state["hparams"]]
        bank.active = None
