"""Population training (``population.size=N``): N members on one frozen base, evolved in one run.

A member is the trainable weights (actor adapter, and PPO's critic adapter and value head), its
own reference adapter when the reference moves (``algo.ref_update_interval``), its optimizer and
scheduler state, its counters (PPO's critic warm-up) and its hyper-parameters. One member at a
time is *resident*: its weights sit in the policy's adapter slots, its state in Lightning's
optimizer and scheduler, its hyper-parameters, sampling and counters in the learner
:class:`~rlhf_lightning.learner.member.Member` this callback's schedule hands the module. The others are copies off the model (a few adapters' memory, never N
models). Training steps go round-robin over the members (the trainer's optimizer steps count
them all; each member's warm-up and cosine schedule spans its own share of them). Every
``population.evolve_every`` steps each member is scored on a held-out slice at one sampling
temperature, then tournament selection with elitism picks each slot's parent, the parent is
cloned (weights and optimizer state copied, the base untouched) and mutated, every mutated
value checked like a start-up value; ``lineage.csv`` records every birth. Validation and the
final export use the fittest member.

The parts: :class:`~rlhf_lightning.population.resident.ResidentMember` (swapping members on
and off the model) and :class:`~rlhf_lightning.population.generations.Generations` (scoring,
selection, lineage), mixed into :class:`Population` with the Lightning hooks and the state.
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

import lightning as L
import torch

from rlhf_lightning.learner.member import Member as LearnerMember
from rlhf_lightning.learner.member import OneMember
from rlhf_lightning.learner.records import StepSummary
from rlhf_lightning.population.evolution import FITNESS
from rlhf_lightning.population.generations import LINEAGE_FIELDS, Generations
from rlhf_lightning.population.members import KEEP_SNAPSHOTS, Member, follow_schedule
from rlhf_lightning.population.resident import ResidentMember

__all__ = ["FITNESS", "KEEP_SNAPSHOTS", "LINEAGE_FIELDS", "Member", "Population"]


class Population(ResidentMember, Generations, L.Callback):
    """Args:
    size: members.
    evolve_every: training steps between evolutions (a multiple of ``size``; 0: never).
    space: the mutation range of each evolved hyper-parameter.
    fitness: ``accuracy_sampled`` | ``accuracy_greedy`` | ``return_sampled`` | ``return_greedy``.
    eval_rows: held-out rows each member is scored on.
    tournament_size, elitism, no_mutation_prob: selection and mutation (``evolution.py``).
    mutate_initial: mutate members 1..N-1 once at the start (member 0 keeps the config's values).
    snapshot_every: write the whole population every this many steps from a background thread
        (rank 0; atomically; the newest ``keep_snapshots`` are kept).
    output_dir: where ``lineage.csv``, ``population/best`` and snapshots go.
    seed: the evolution's random stream (the same on every rank).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # the settings and bookkeeping (Generations)
        self.resident: int | None = None  # the slot whose state is on the model
        self._own_steps = 1  # each member's share of the optimizer steps (set at fit start)
        self._base_hp: Any = None
        self._ref_interval: int | None = None  # members' own references move every this many updates
        self.member_schedule: OneMember | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Before the module's setup: the resident's learner state, the schedule it learns by."""
        if stage == "fit" and self.member_schedule is None:
            module: Any = pl_module
            state = module.learner.family.initial_state()
            self.member_schedule = OneMember(LearnerMember(module.hp, module.sampling, state=state))

    # ------------------------------------------------------------------ Lightning hooks
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        module: Any = pl_module
        self.module = module
        self._base_hp = module.hp
        self._base_temperature = float(module.sampling.temperature)
        self._ref_interval = getattr(self._base_hp, "ref_update_interval", None) or None
        self._algo = dataclasses.asdict(self._base_hp)
        self.check_space("lora" if module.policy.is_peft else "full", module.world_size)
        # Each member's warm-up and cosine run over its own share of the optimizer steps (and to
        # its own min_lr_ratio: apply_hparams).
        self._own_steps = max(module.total_optimizer_steps() // self.size, 1)
        follow_schedule(self.scheduler(), self._base_hp, self._own_steps)
        if self._restored is not None:  # a resume: the checkpoint's population
            self._load_population(self._restored)
            self._restored = None
            return
        self.first_generation(self.capture, trainer.global_step)
        self.resident = 0
        self.apply_hparams(self.members[0].hparams)
        self.write_lineage(trainer)

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.load(self.steps % self.size)

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        self.refresh_reference()  # after the previous update of this batch (weights not yet stepped)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.refresh_reference()  # after the batch's last update
        slot = self.steps % self.size
        self.steps += 1
        step = getattr(pl_module, "last_step", None) or StepSummary()
        shown = {"reward_mean": step.reward_mean, "loss": step.loss, "lr": step.lr}
        keep = {f"member_{slot}/{k}": torch.tensor(v) for k, v in shown.items() if v is not None}
        keep[f"member_{slot}/id"] = torch.tensor(float(self.members[slot].id))
        pl_module.log_metrics(keep)  # type: ignore[operator]
        if self.evolve_every and self.steps % self.evolve_every == 0:
            self.evolve(trainer)
        self.maybe_snapshot(trainer)

    # ------------------------------------------------------------------ state: checkpoints and snapshots
    def population_state(self) -> dict[str, Any]:
        """Copies of everything that decides the population's future (members, RNG, counters)."""
        self.store()
        return {
            "members": [dataclasses.asdict(m) for m in self.members],  # deep copies
            "resident": self.resident,
            "steps": self.steps,
            "next_id": self.next_id,
            "scored_at": self.scored_at,
            "rng": self.rng.getstate(),
            "lineage": [dict(r) for r in self.lineage],
        }

    def snapshot(self, path: Path) -> threading.Thread:
        """Write the population as it is now from a background thread; training goes on (the
        snapshot holds copies, so later updates do not reach it). See :func:`write_snapshot`."""
        state = self.population_state()
        state["members"] = [
            m | {k: [w.detach().cpu() for w in m[k]] for k in ("weights", "reference")}
            for m in state["members"]
        ]
        return self.write_in_background(state, path)

    def _load_population(self, state: dict[str, Any]) -> None:
        self.restore_bookkeeping(state)
        shared = [p.detach().clone() for p in self.reference_params()]
        for m in self.members:  # a checkpoint from before members had their own: the shared one
            m.reference = m.reference or [w.clone() for w in shared]
        # Lightning restored the resident's weights, optimizer and scheduler; its hyper-parameters:
        self.resident = state["resident"]
        if self.resident is not None:
            self.apply_hparams(self.members[self.resident].hparams)
