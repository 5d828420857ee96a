"""Population training with members side by side (``population.batched=true``).

The members live on the module (:class:`~rlhf_lightning.algorithms.members.MemberAPI`): one
named LoRA adapter, optimizer and schedule each. Every training step (a *population step*) is
one rollout for every member and one update of each (``population_step.py``), so
``trainer.max_steps`` counts member updates: population steps x members x optimizer steps per
batch (both are logged: ``population/steps``, ``population/member_updates``). Every
``population.evolve_every`` population steps each member is scored on the held-out rows at one
temperature, all members in one engine call; tournament selection with elitism picks each slot's
parent, which is copied into the slot (adapters in place, optimizer and schedule state) and
mutated through the module, which checks every value like a start-up value. This callback keeps
the bookkeeping: ids, parents, fitness, the lineage and snapshots.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import lightning as L
import torch

from rlhf_lightning.population.checks import check_member, validate_space
from rlhf_lightning.population.evolution import tournament_select
from rlhf_lightning.population.generations import Generations
from rlhf_lightning.population.members import Member
from rlhf_lightning.runtime import rng as rng_state


class SideBySidePopulation(Generations, L.Callback):
    """Args: as :class:`~rlhf_lightning.population.callback.Population`, but ``evolve_every``
    counts population steps (every member updated once each)."""

    every_multiple_of_size = False

    # ------------------------------------------------------------------ Lightning hooks
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Before the optimizers are configured: the members on the module (a resume then loads
        the checkpoint's over them)."""
        if stage != "fit" or self.members:
            return
        module: Any = pl_module
        self.module = module
        self._base_temperature = float(module.sampling.temperature)
        self._algo = dataclasses.asdict(module.hp)
        finetune = "lora" if module.policy.is_peft else "full"
        space = {name: dataclasses.asdict(r) for name, r in self.space.items()}
        validate_space(space, self._algo, finetune, trainer.world_size)  # as at start-up
        base = self.initial_hparams()
        for slot in range(self.size):
            hp, how = (
                self.mutated(base, self.next_id, 0.0) if self.mutate_initial and slot else (base, "none")
            )
            self.members.append(Member(self.next_id, dict(hp)))
            self.record(0, slot, None, "init", how, None)
            self.next_id += 1
        module.enable_members([m.hparams for m in self.members], check_member)

    def initial_hparams(self) -> dict[str, float]:
        from rlhf_lightning.population.evolution import MUTABLE

        hp = {k: self._algo[k] for k in MUTABLE if k in self._algo}
        hp["temperature"] = self._base_temperature
        return {k: v for k, v in hp.items() if v is not None}

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._restored is not None:  # a resume: the checkpoint's bookkeeping (the module has its members)
            state, self._restored = self._restored, None
            self.members = [Member(**m) for m in state["members"]]
            self.steps, self.next_id = state["steps"], state["next_id"]
            self.rng.setstate(state["rng"])
            self.lineage = [dict(r) for r in state["lineage"]]
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

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.members:
            self.module.show_member(self.best_slot())

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for t in self.snapshots:
            t.join()
        if not self.members:
            return
        best = self.best_slot()
        self.module.show_member(best)
        if trainer.is_global_zero:
            out = self.module.policy.save_adapter(self.output_dir / "population" / "best")
            if out is not None:
                print(
                    f"population: best member {self.members[best].id} (fitness {self.members[best].fitness}) -> {out}"
                )

    # ------------------------------------------------------------------ generations
    @torch.no_grad()
    def score(self, trainer: L.Trainer) -> list[float]:
        """Each member's fitness on the first ``eval_rows`` held-out rows, every member in one
        engine call at one temperature (all ranks: the mean)."""
        rows, temperature = self.held_out(trainer)
        saved = rng_state.capture()  # scoring draws no numbers from training's streams
        results = self.module.score_members(rows, temperature)
        rng_state.restore(saved)
        return [self.fitness_of(result) for result in results]

    def evolve(self, trainer: L.Trainer) -> None:
        module = self.module
        fitness = self.score(trainer)
        for m, f in zip(self.members, fitness):
            m.fitness = f
        step, best = trainer.global_step, self.best_slot()
        best_lr = float(self.members[best].hparams.get("lr", 0.0))
        parents = tournament_select(fitness, self.rng, self.tournament_size, self.elitism)
        states = [module.member_state(p) for p in parents]  # copies, before any slot is overwritten
        new: list[Member] = []
        for slot, p in enumerate(parents):
            parent = self.members[p]
            if slot == 0 and self.elitism:
                child = Member(parent.id, dict(parent.hparams), parent=parent.parent, fitness=parent.fitness)
                event, how = "elite", "none"
            else:
                child = Member(self.next_id, dict(parent.hparams), parent=parent.id, fitness=parent.fitness)
                self.next_id += 1
                child.hparams, how = self.mutated(parent.hparams, child.id, self.no_mutation_prob)
                event = "clone"
            states[slot]["hparams"] = dict(child.hparams)
            module.load_member_state(slot, states[slot])
            new.append(child)
            self.record(step, slot, child, event, how, fitness[p])
        self.members = new
        self.check_ranks_agree()
        module.log_metrics(
            {
                "population/fitness_best": torch.tensor(max(fitness)),
                "population/fitness_mean": torch.tensor(sum(fitness) / len(fitness)),
                "population/best_lr": torch.tensor(best_lr),  # the fittest member scored now
            }
        )
        self.write_lineage(trainer)

    def check_ranks_agree(self) -> None:
        """After selection every rank must hold the same members: ids, hyper-parameters and each
        member's adapter weights (their sum in float64), compared across ranks."""
        module = self.module
        if module.world_size <= 1:
            return
        from rlhf_lightning.population.evolution import MUTABLE

        rows = []
        for k, m in enumerate(self.members):
            weights = module.member_state(k)["weights"].values()
            total = float(sum(w.double().sum() for w in weights))
            rows.append([float(m.id), *(float(m.hparams.get(n) or 0.0) for n in MUTABLE), total])
        digest = torch.tensor(rows, dtype=torch.float64, device=module.device)
        gathered = module.all_gather(digest)
        if not bool((gathered == gathered[0]).all()):
            raise RuntimeError(
                f"population: ranks disagree after selection at step {self.steps}: {gathered.tolist()}"
            )

    # ------------------------------------------------------------------ state
    def population_state(self, with_members: bool = False) -> dict[str, Any]:
        """The bookkeeping (the module's checkpoint holds the members); ``with_members``: each
        member's whole state too (a snapshot)."""
        members = [dataclasses.asdict(m) for m in self.members]
        if with_members:
            for k, m in enumerate(members):
                state = self.module.member_state(k)
                state["weights"] = {n: w.cpu() for n, w in state["weights"].items()}
                m["state"] = state
        return {
            "members": members,
            "steps": self.steps,
            "next_id": self.next_id,
            "rng": self.rng.getstate(),
            "lineage": [dict(r) for r in self.lineage],
        }

    def maybe_snapshot(self, trainer: L.Trainer) -> threading.Thread | None:
        """Every ``snapshot_every`` population steps, rank 0 writes every member from a thread."""
        if not self.snapshot_every or self.steps % self.snapshot_every or not trainer.is_global_zero:
            return None
        path = self.output_dir / "population" / f"snapshot_step_{self.steps:06d}.pt"
        return self.write_in_background(self.population_state(True), path)
