"""Population training with members side by side (``population.batched=true``).

The members are this callback's schedule (:class:`~rlhf_lightning.population.bank.SideBySide`),
which the module takes at setup: one named LoRA adapter, optimizer and schedule each. Every
training step (a *population step*) is one rollout for every member and one update of each, so
``trainer.max_steps`` counts member updates: population steps x members x optimizer steps per
batch (both are logged: ``population/steps``, ``population/member_updates``). Every
``population.evolve_every`` population steps each member is scored on the held-out rows at one
temperature, all members in one engine call; tournament selection with elitism picks each slot's
parent, which is copied into the slot (adapters in place, optimizer and schedule state) and
mutated, every value checked like a start-up value. This callback keeps
the bookkeeping: ids, parents, fitness, the lineage and snapshots.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path
from typing import Any

import lightning as L
import torch

from rlhf_lightning.population.bank import SideBySide
from rlhf_lightning.population.checks import check_member
from rlhf_lightning.population.generations import Generations
from rlhf_lightning.population.members import Member
from rlhf_lightning.runtime.channel import write_atomic


def tensor_digest(w: torch.Tensor) -> tuple[float, float]:
    """``w``'s sum and its sum weighted by position (1 at the first element, 2 at the last)."""
    flat = w.detach().double().flatten()
    ramp = torch.linspace(1.0, 2.0, flat.numel(), dtype=torch.float64, device=flat.device)
    return float(flat.sum()), float((flat * ramp).sum())


class SideBySidePopulation(Generations, L.Callback):
    """Args: as :class:`~rlhf_lightning.population.callback.Population`, but ``evolve_every``
    counts population steps (every member updated once each)."""

    every_multiple_of_size = False
    member_schedule: SideBySide | None = None  # the module takes it at setup

    # ------------------------------------------------------------------ Lightning hooks
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Before the module's setup and its optimizers: the members side by side on the base (a
        resume then loads the checkpoint's over them)."""
        if stage != "fit" or self.members:
            return
        module: Any = pl_module
        self.module = module
        self._base_temperature = float(module.sampling.temperature)
        self._algo = dataclasses.asdict(module.hp)
        self.check_space("lora" if module.policy.is_peft else "full", trainer.world_size)
        self.first_generation(lambda member_id, hp: Member(member_id, dict(hp)), trainer.global_step)
        self.member_schedule = SideBySide(module, [m.hparams for m in self.members], check_member)
        self.member_schedule.check_steps(trainer.max_steps, trainer.world_size)

    @property
    def bank(self) -> SideBySide:
        assert self.member_schedule is not None, "the population is set up at the fit's setup"
        return self.member_schedule

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._restored is not None:  # a resume: the checkpoint's bookkeeping (the module has its members)
            self.restore_bookkeeping(self._restored)
            self._restored = None
            for k, m in enumerate(self.members):  # Lightning restored the optimizers and schedules
                self.bank.adopt_hparams(k, m.hparams)
        self.write_lineage(trainer)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.steps += 1
        shown = {f"member_{k}/id": torch.tensor(float(m.id)) for k, m in enumerate(self.members)}
        shown["population/steps"] = torch.tensor(float(self.steps))
        self.module.log_metrics(shown)
        if self.evolve_every and self.steps % self.evolve_every == 0:
            self.evolve(trainer)
        self.maybe_snapshot(trainer)

    def show(self, slot: int) -> None:
        self.bank.show(slot)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: Any) -> None:
        """The fittest member (by its last fitness; slot 0 before any member is scored) in the
        trainable slots, so the adapters exported with this checkpoint (``adapters/step_N``,
        ``adapters/last``, after this callback) are that member's; ``member.json`` beside them
        names it."""
        if not self.members:
            return
        best = self.best_slot()
        self.show(best)
        if trainer.is_global_zero:
            m = self.members[best]
            info = {
                "step": trainer.global_step,
                "slot": best,
                "id": m.id,
                "fitness": m.fitness,
                "hparams": m.hparams,
            }
            adapters = self.output_dir / "checkpoints" / "adapters"
            for d in (adapters / f"step_{trainer.global_step:06d}", adapters / "last"):
                d.mkdir(parents=True, exist_ok=True)
                write_atomic(d / "member.json", json.dumps(info, indent=1).encode())

    # ------------------------------------------------------------------ generations
    def member_results(self, rows: list[int], temperature: float) -> list[Any]:
        """Every member's evaluation episodes for ``rows``, all in one engine call."""
        return self.bank.score_members(rows, temperature)

    def place(self, parents: list[int]) -> None:
        """Copy each slot's parent into it (adapters in place, optimizer and schedule state,
        counters), with the slot's new hyper-parameters (checked first)."""
        states = [self.bank.member_state(p) for p in parents]  # copies, before any slot is overwritten
        for slot, state in enumerate(states):
            self.bank.load_member_state(slot, state | {"hparams": dict(self.members[slot].hparams)})

    def member_digest(self, slot: int) -> list[float]:
        """Two numbers per weight tensor, in name order: its sum and a position-weighted sum
        (float64), so tensors in other slots, values moved within a tensor and drifts that
        cancel out in a sum all show."""
        weights = self.bank.member_weights(slot)
        return [v for name in sorted(weights) for v in tensor_digest(weights[name])]

    # ------------------------------------------------------------------ state
    def population_state(self, with_members: bool = False) -> dict[str, Any]:
        """The bookkeeping (the module's checkpoint holds the members' weights); ``with_members``: each
        member's whole state too (a snapshot)."""
        members = [dataclasses.asdict(m) for m in self.members]
        if with_members:
            for k, m in enumerate(members):
                state = self.bank.member_state(k)
                state["weights"] = {n: w.cpu() for n, w in state["weights"].items()}
                m["state"] = state
        return {
            "members": members,
            "steps": self.steps,
            "next_id": self.next_id,
            "scored_at": self.scored_at,
            "rng": self.rng.getstate(),
            "lineage": [dict(r) for r in self.lineage],
        }

    def snapshot(self, path: Path) -> threading.Thread:
        """Every member's whole state, written from a background thread."""
        return self.write_in_background(self.population_state(True), path)
