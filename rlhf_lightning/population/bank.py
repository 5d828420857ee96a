"""Members side by side on one frozen base: the schedule of ``population.batched=true``.

Member ``k`` is the named LoRA adapter ``member_k`` (its actor; with a moving reference also
``member_k_ref``; PPO's critic ``member_k_critic`` and a value head of its own), its own AdamW and
schedule (the module's optimizer and scheduler ``k``), and a
:class:`~rlhf_lightning.learner.member.Member` with its own hyper-parameters, sampling, counters
and guard record. Every step samples every member in one engine call (per-row adapters; one call
per distinct temperature) and each member then learns on its own rows in the trainable slots,
where :meth:`SideBySide.in_slots` copies its adapters in and, after its update, back out (a LoRA
adapter's weights: a few megabytes at most).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
from peft import PeftModel

from rlhf_lightning.config.algo import with_hparams
from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.learner.member import Member
from rlhf_lightning.learner.optimizer import set_base_lrs
from rlhf_lightning.learner.plan import UpdatePlan
from rlhf_lightning.models.adapters import copy_adapter
from rlhf_lightning.population.members import follow_schedule
from rlhf_lightning.records.metrics import episode_metrics
from rlhf_lightning.records.result import RolloutResult
from rlhf_lightning.records.trajectory import Trajectory, collate
from rlhf_lightning.rollout.source import RolloutSource

# (hyper-parameters, the algorithm's config values, world size, member id) -> raises if invalid
MemberCheck = Callable[[dict[str, float], dict[str, Any], int, int], None]
# Counts a rollout call reports for all its episodes: summed over the calls of a step.
CALL_COUNTS = ("rollout/dropped_long_prompts", "env/reward_errors", "env/step_timeouts")


def member_adapter(k: int) -> str:
    return f"member_{k}"


def member_reference(k: int) -> str:
    return f"member_{k}_ref"


def member_critic(k: int) -> str:
    return f"member_{k}_critic"


def split_by_adapter(
    trajs: list[Trajectory], adapters: list[str], pad_token_id: int
) -> dict[str, RolloutResult]:
    """Each adapter's trajectories of one mixed rollout as a batch of its own, group ids from 0
    (a member's groups are contiguous in the rollout), with its own harness metrics."""
    out: dict[str, RolloutResult] = {}
    for name in adapters:
        mine = [t for t in trajs if t.adapter == name]
        if not mine:
            raise RuntimeError(f"the population rollout returned no episode of {name}")
        first = mine[0].group_id
        for t in mine:
            t.group_id -= first
        out[name] = RolloutResult(collate(mine, pad_token_id), mine, episode_metrics(mine))
    return out


def call_metrics(calls: list[dict[str, float]]) -> dict[str, float]:
    """The metrics that rollout calls report for all their episodes at once, not per member
    (dropped prompts, env errors and timeouts, a reward model's batch statistics): counts summed
    over the calls, anything else their mean. Logged once under the plain names, never copied
    into every ``member_k/*``."""
    keys = sorted(set().union(*calls)) if calls else []
    out = {}
    for k in keys:
        values = [c[k] for c in calls if k in c]
        out[k] = float(sum(values)) if k in CALL_COUNTS else float(sum(values) / len(values))
    return out


class SideBySide:
    """The members side by side (a :class:`~rlhf_lightning.learner.member.MemberSchedule`).

    Args:
        module: the rollout module (read: its policy, engine, optimizers, base settings).
        hparams: each member's values (``algo.<name>``, and ``temperature``).
        check: raises on a value that could not train (the population's start-up rules); every
            member's values pass it, at start and at every :meth:`set_hparams`.

    Adds one adapter set per member on the base, each a copy of the trainable slots as they are
    now (the actor; the reference when it moves; PPO's critic and value head). Only LoRA
    policies: members share the frozen base.
    """

    side_by_side = True

    def __init__(self, module: Any, hparams: list[dict[str, float]], check: MemberCheck) -> None:
        self.module, self.policy = module, module.policy
        model = self.policy.model
        if not isinstance(model, PeftModel) or self.policy.adapter_name is None:
            raise ValueError("members side by side need a LoRA policy (model.finetune=lora)")
        self.base_hp, self.base_sampling = module.hp, module.sampling
        self.own_reference = bool(getattr(self.base_hp, "ref_update_interval", None))
        self.check = check
        self.hparams = [dict(h) for h in hparams]
        self.active: int | None = None  # whose adapters are in the trainable slots now
        for k in range(len(hparams)):
            for name, src in self._slots(k):
                if name not in model.peft_config:
                    with torch.random.fork_rng(devices=[]):  # its init draws nothing from training's streams
                        model.add_adapter(name, model.peft_config[src])
                with torch.no_grad():
                    copy_adapter(model, src, name)
        model.set_adapter(self.policy.adapter_name)  # add_adapter may move the active one
        head = self.policy.value_head
        if head is not None:  # PPO: each member's value head beside its critic adapter (in the checkpoint)
            heads = torch.nn.ModuleList(copy.deepcopy(head) for _ in hparams)
            self.policy.add_module("member_value_heads", heads.requires_grad_(False))
        for n, p in self.policy.named_parameters():  # members train only in the trainable slots
            if ".member_" in n or n.startswith("member_"):
                p.requires_grad_(False)
        family = module.learner.family
        self.members = [
            Member(
                self.member_hp(k),
                self.member_sampling(k),
                optimizer=k,
                adapter=member_adapter(k),
                own_reference=self.own_reference,
                state=family.initial_state(),
            )
            for k in range(len(hparams))
        ]
        self._pair_cache: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for k, h in enumerate(self.hparams):
            self.check_hparams(h, k)

    @property
    def size(self) -> int:
        return len(self.hparams)

    @property
    def adapters(self) -> list[str]:
        return [member_adapter(k) for k in range(self.size)]

    def learning_now(self) -> list[Member]:
        return self.members

    def check_steps(self, max_steps: int | None, world_size: int) -> None:
        """``trainer.max_steps`` counts member updates (optimizer steps): a whole number of
        population steps, so that every member takes the same number."""
        per = UpdatePlan.from_hp(self.base_hp, world_size).optimizer_steps_per_batch() * self.size
        if max_steps and max_steps > 0 and max_steps % per:
            raise ConfigError(
                "trainer.max_steps",
                max_steps,
                f"it counts member updates: each population step takes {per} ({self.size} members x "
                f"{per // self.size} optimizer steps); set a multiple of {per}",
            )

    # ---------------------------------------------------------------- hyper-parameters
    def member_hp(self, k: int) -> Any:
        """Member ``k``'s algorithm config: the run's, with its own values (its reference moves
        on its own optimizer steps)."""
        return with_hparams(self.base_hp, self.hparams[k])

    def member_sampling(self, k: int) -> Any:
        t = self.hparams[k].get("temperature", self.base_sampling.temperature)
        return dataclasses.replace(self.base_sampling, temperature=t)

    def check_hparams(self, hparams: dict[str, float], member_id: int) -> None:
        """Every value checked like a start-up value (bounds, integers, the batch geometry)."""
        self.check(hparams, dataclasses.asdict(self.base_hp), self.module.world_size, member_id)

    def set_hparams(self, k: int, hparams: dict[str, float], member_id: int | None = None) -> None:
        """Give member ``k`` these hyper-parameters (checked first); its optimizer's learning rate
        follows at once, its schedule's position kept."""
        self.check_hparams(hparams, k if member_id is None else member_id)
        self.adopt_hparams(k, hparams)
        hp = self.members[k].hp
        groups = self.module.learner.family.param_groups(self.policy, hp)
        set_base_lrs(self.optimizer(k), self.scheduler(k), [g.get("lr", hp.lr) for g in groups])

    def adopt_hparams(self, k: int, hparams: dict[str, float]) -> None:
        """Member ``k``'s values (a resume's: its optimizer and schedule were restored), and its
        schedule's shape (its own ``min_lr_ratio``) from its next step on."""
        self.hparams[k] = dict(hparams)
        self.members[k].set_hp(self.member_hp(k), self.member_sampling(k))
        own = max(self.module.total_optimizer_steps() // self.size, 1)  # as configure_optimizers
        follow_schedule(self.scheduler(k), self.members[k].hp, own)

    def optimizer(self, k: int) -> torch.optim.Optimizer:
        opt = self.module.stepper.optimizer(k)
        return cast(torch.optim.Optimizer, getattr(opt, "optimizer", opt))

    def scheduler(self, k: int) -> Any:
        return self.module.stepper.scheduler(k)

    # ---------------------------------------------------------------- rollouts
    def rollouts(
        self, source: RolloutSource, rows: list[int]
    ) -> tuple[list[tuple[Member, RolloutResult]], dict]:
        results, whole = self.member_rollouts(rows, source=source)
        return [(m, results[cast(str, m.adapter)]) for m in self.members], {
            k: torch.tensor(v) for k, v in whole.items()
        }

    def member_rollouts(
        self,
        rows: list[int],
        evaluation: bool = False,
        temperature: float | None = None,
        source: RolloutSource | None = None,
    ) -> tuple[dict[str, RolloutResult], dict[str, float]]:
        """Every member's episodes for ``rows``, sampled side by side: one engine call per distinct
        temperature (``temperature``: one for all, e.g. fitness); evaluation: one episode per row.
        Also the metrics the calls report for all their episodes at once (:func:`call_metrics`).
        ``source``: the module's (:class:`~rlhf_lightning.rollout.source.RolloutSource`)."""
        source = source if source is not None else self.module.source
        if hasattr(source.engine, "sync_adapters"):  # vLLM: one LoRA slot per member, loaded in place
            source.engine.sync_adapters(self.policy, self.adapters)
        calls: dict[float, list[int]] = {}
        for k in range(self.size):
            t = temperature if temperature is not None else self.members[k].sampling.temperature
            calls.setdefault(float(t), []).append(k)
        out: dict[str, RolloutResult] = {}
        whole: list[dict[str, float]] = []
        pad = source.pad_token_id
        for t, ks in calls.items():
            params = dataclasses.replace(self.members[ks[0]].sampling, temperature=t)
            sizes = [1 if evaluation else int(self.members[k].hp.group_size) for k in ks for _ in rows]
            names = [self.adapters[k] for k in ks for _ in rows]
            result = source.generate(
                rows * len(ks), params, group_size=1, evaluation=evaluation, adapters=names, group_sizes=sizes
            )
            split = split_by_adapter(result.trajectories, [self.adapters[k] for k in ks], pad)
            out.update(split)
            own = set().union(*(r.metrics for r in split.values()))
            whole.append({k: v for k, v in result.metrics.items() if k not in own})
        return {name: out[name] for name in self.adapters}, call_metrics(whole)

    @torch.no_grad()
    def score_members(self, rows: list[int], temperature: float) -> list[RolloutResult]:
        """Every member's evaluation episodes for ``rows`` at one ``temperature``, in one call."""
        results, _ = self.member_rollouts(rows, evaluation=True, temperature=temperature)
        return [results[name] for name in self.adapters]

    # ---------------------------------------------------------------- one member in the slots
    def _slots(self, k: int) -> list[tuple[str, str]]:
        """(member's adapter, trainable slot) pairs of member ``k``: actor, own reference, critic."""
        pairs = [(member_adapter(k), cast(str, self.policy.adapter_name))]
        if self.own_reference:
            pairs.append((member_reference(k), cast(str, self.policy.reference_adapter)))
        if self.policy.critic_adapter is not None:
            pairs.append((member_critic(k), cast(str, self.policy.critic_adapter)))
        return pairs

    def _pairs(self, k: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Member ``k``'s weights and the trainable slots' matching ones, found once."""
        if k not in self._pair_cache:
            mine = self._member_params(k)
            slots = self._keyed([slot for _, slot in self._slots(k)], self.policy.value_head)
            self._pair_cache[k] = (list(mine.values()), [slots[n] for n in mine])
        return self._pair_cache[k]

    @contextmanager
    def in_slots(self, member: Member) -> Iterator[None]:
        """``member``'s adapters in the trainable slots, copied back after its update."""
        k = self.members.index(member)
        self.show(k)
        try:
            yield
        finally:
            mine, slots = self._pairs(k)
            with torch.no_grad():
                torch._foreach_copy_(mine, slots)

    def show(self, k: int) -> None:
        """Copy member ``k``'s adapters into the trainable slots (training, evaluation, export)."""
        mine, slots = self._pairs(k)
        with torch.no_grad():
            torch._foreach_copy_(slots, mine)
        self.active = k
        if self.module.engine is not None:  # vLLM's actor slot syncs again before it samples
            self.module.engine.invalidate()

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
        heads = getattr(self.policy, "member_value_heads", None)
        head = heads[k] if heads is not None else None
        return self._keyed([member for member, _ in self._slots(k)], head)

    def member_weights(self, k: int) -> dict[str, torch.Tensor]:
        """Member ``k``'s weights by name, detached but not copied: to read, never to keep."""
        return {n: p.detach() for n, p in self._member_params(k).items()}

    def member_state(self, k: int) -> dict[str, Any]:
        """Copies of everything member ``k`` is: its adapters' weights, its optimizer's and
        schedule's state, its hyper-parameters, its counters and its guard record."""
        return {
            "weights": {n: w.clone() for n, w in self.member_weights(k).items()},
            "optimizer": copy.deepcopy(self.optimizer(k).state_dict()),
            "scheduler": copy.deepcopy(self.scheduler(k).state_dict()),
            "hparams": dict(self.hparams[k]),
            "health": self.members[k].health.state_dict(),
            "counters": dict(self.members[k].state),
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
        self.optimizer(k).load_state_dict(copy.deepcopy(state["optimizer"]))  # nothing shared
        self.scheduler(k).load_state_dict(copy.deepcopy(state["scheduler"]))
        self.members[k].health.load_state_dict(state.get("health", {}))
        self.members[k].state = dict(state.get("counters", self.members[k].state))
        self.set_hparams(k, state["hparams"])
        if self.active == k:
            self.active = None  # the slots hold what member k was
