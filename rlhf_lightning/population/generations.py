"""A population's generations: the first members drawn from the mutation space's prior (or the
config's values), every member scored on held-out rows, truncation (or tournament) selection,
parents cloned and explored (a value perturbed or resampled from the prior; every value checked
like a start-up value), and every birth recorded in ``lineage.csv``. :class:`Generations` is mixed into
:class:`~rlhf_lightning.population.callback.Population`.
"""

from __future__ import annotations

import csv
import dataclasses
import random
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch

from rlhf_lightning.algorithms.evaluation import episode_success
from rlhf_lightning.population.checks import check_member, check_settings, node_value, validate_space
from rlhf_lightning.population.evolution import (
    MUTABLE,
    MutationRange,
    mutate,
    sample_prior,
    tournament_select,
    truncation_select,
)
from rlhf_lightning.population.members import KEEP_SNAPSHOTS, Member, write_snapshot
from rlhf_lightning.population.multi_frequency import MultiFrequency, evolving, mf_pbt_plan
from rlhf_lightning.runtime import rng as rng_state

LINEAGE_FIELDS = ["step", "slot", "id", "parent", "event", "mutation", "parent_fitness", *MUTABLE]


class Generations:
    """Scoring, selection, cloning and the lineage of a population.

    The attributes below are set by ``Population.__init__`` and ``on_fit_start``; ``load`` comes
    from :class:`~rlhf_lightning.population.resident.ResidentMember`."""

    module: Any
    members: list[Member]
    resident: int | None
    size: int
    steps: int
    next_id: int
    space: dict[str, MutationRange]
    rng: random.Random
    fitness_name: str
    eval_rows: int
    tournament_size: int
    elitism: bool
    no_mutation_prob: float
    lineage: list[dict[str, Any]]
    output_dir: Path
    _base_temperature: float
    _algo: dict[str, Any]

    load: Callable[[int], None]  # ResidentMember.load: make a slot resident
    # Round-robin: evolutions every so many training steps, a multiple of the size (each member
    # trains as often); side by side they count population steps.
    every_multiple_of_size = True

    def __init__(
        self,
        size: int,
        evolve_every: int,
        space: dict[str, MutationRange],
        output_dir: str | Path,
        fitness: str = "accuracy_sampled",
        eval_rows: int = 100,
        tournament_size: int = 2,
        elitism: bool = True,
        no_mutation_prob: float = 0.2,
        mutate_initial: bool = False,
        snapshot_every: int = 0,
        seed: int = 0,
        keep_snapshots: int = KEEP_SNAPSHOTS,
        init: str = "config",
        selection: str = "tournament",
        truncation: float = 0.25,
        resample_prob: float = 0.0,
        schedule: str = "pbt",
        mf_pbt: Any = None,
    ) -> None:
        check_settings(
            size,
            evolve_every,
            space,
            fitness,
            keep_snapshots,
            self.every_multiple_of_size,
            init,
            selection,
            truncation,
            resample_prob,
            schedule,
        )
        # population.schedule=mf_pbt: the sub-populations (None: every member evolves each time)
        self.multi_frequency = MultiFrequency.from_config(size, mf_pbt) if schedule == "mf_pbt" else None
        self.init, self.selection, self.truncation, self.resample_prob = (
            init,
            selection,
            truncation,
            resample_prob,
        )
        self.size, self.evolve_every, self.space = size, evolve_every, dict(space)
        self.fitness_name, self.eval_rows = fitness, eval_rows
        self.tournament_size, self.elitism, self.no_mutation_prob = tournament_size, elitism, no_mutation_prob
        self.mutate_initial, self.snapshot_every = mutate_initial, snapshot_every
        self.keep_snapshots = keep_snapshots
        self.output_dir = Path(output_dir)
        self.rng = random.Random(seed)
        self.members = []
        self.steps = 0  # training steps (round-robin) or population steps (side by side)
        self.scored_at: int | None = None  # the step count of the last scoring (every member then)
        self.next_id = 0
        self.lineage = []
        self.snapshots: list[threading.Thread] = []
        self.module = None
        self._base_temperature = 1.0
        self._algo = {}  # the algorithm's config values (mutated values are checked)
        self._restored: dict[str, Any] | None = None

    @property
    def carried(self) -> tuple[str, ...]:
        """The hyper-parameters each member carries (and the lineage shows): :data:`MUTABLE`, and
        the node paths (``loss.<param>``) the space mutates."""
        return (*MUTABLE, *sorted(n for n in self.space if n not in MUTABLE))

    def initial_hparams(self) -> dict[str, float]:
        """The config's values of every mutable hyper-parameter it sets, and the temperature."""
        hp = {k: self._algo[k] for k in MUTABLE if k in self._algo}
        hp.update({k: node_value(self._algo, k) for k in self.carried if k not in MUTABLE})
        hp["temperature"] = self._base_temperature
        return {k: v for k, v in hp.items() if v is not None}

    def check_space(self, finetune: str, world_size: int) -> None:
        """``population.mutate`` checked against the algorithm's values, as at start-up."""
        space = {name: dataclasses.asdict(r) for name, r in self.space.items()}
        validate_space(space, self._algo, finetune, world_size)

    def first_generation(self, make: Callable[[int, dict[str, float]], Member], step: int) -> None:
        """The members at the start; ``make(id, hparams)`` builds each. ``init=sample``: every
        member's values of the mutation space drawn from its prior (the population's seeded RNG,
        so every rank draws the same), each checked like a start-up value; ``init=config``: the
        config's values, members 1..N-1 mutated once with ``mutate_initial``."""
        base = self.initial_hparams()
        for slot in range(self.size):
            if self.init == "sample":
                hp, how = sample_prior(base, self.space, self.rng)
                check_member(hp, self._algo, self.module.world_size, self.next_id)
            elif self.mutate_initial and slot:
                hp, how = self.mutated(base, self.next_id, 0.0)
            else:
                hp, how = base, "none"
            self.members.append(make(self.next_id, hp))
            self.record(step, slot, None, "init", how, None)
            self.next_id += 1

    def restore_bookkeeping(self, state: dict[str, Any]) -> None:
        """Members, counters, the evolution's RNG and the lineage from a checkpoint's state."""
        self.members = [Member(**m) for m in state["members"]]
        self.steps, self.next_id = state["steps"], state["next_id"]
        self.scored_at = state.get("scored_at")
        self.rng.setstate(state["rng"])
        self.lineage = [dict(r) for r in state["lineage"]]

    def show(self, slot: int) -> None:
        """Put member ``slot`` on the model for evaluation and export (round-robin: resident)."""
        self.load(slot)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.members:
            self.show(self.best_slot())

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Wait for the snapshots; every member scored now unless the last evolution just did
        (a fitness from before the last updates, or a child's that was never scored, must not
        pick the member to export); the fittest member on the model, its adapters written."""
        for t in self.snapshots:
            t.join()
        if not self.members:
            return
        if self.scored_at != self.steps:
            self.assign_fitness(self.score(trainer))
        best = self.best_slot()
        self.show(best)
        if trainer.is_global_zero:
            out = self.module.policy.save_adapter(self.output_dir / "population" / "best")
            if out is not None:
                m = self.members[best]
                print(f"population: best member {m.id} (fitness {m.fitness}) -> {out}")

    def snapshot(self, path: Path) -> threading.Thread:
        raise NotImplementedError

    def maybe_snapshot(self, trainer: L.Trainer) -> threading.Thread | None:
        """Every ``snapshot_every`` steps, rank 0 writes the population (every rank holds the same)."""
        if not self.snapshot_every or self.steps % self.snapshot_every or not trainer.is_global_zero:
            return None
        return self.snapshot(self.output_dir / "population" / f"snapshot_step_{self.steps:06d}.pt")

    def held_out(self, trainer: L.Trainer) -> tuple[list[int], float]:
        """This rank's share of the first ``eval_rows`` held-out rows, and the one temperature every
        member is scored at (the config's rollout temperature; 0 for ``*_greedy``)."""
        module = self.module
        n = min(self.eval_rows, trainer.datamodule.eval_rows)  # type: ignore[attr-defined]
        rows = list(range(module.rank, n, module.world_size))
        return rows, self._base_temperature if self.fitness_name.endswith("_sampled") else 0.0

    def write_in_background(self, state: dict[str, Any], path: Path) -> threading.Thread:
        """Write ``state`` (copies) to ``path`` from a thread (:func:`write_snapshot`); training goes on."""
        path.parent.mkdir(parents=True, exist_ok=True)
        self.snapshots = [t for t in self.snapshots if t.is_alive()]
        thread = threading.Thread(
            target=write_snapshot, args=(state, path, self.keep_snapshots), daemon=False
        )
        thread.start()
        self.snapshots.append(thread)
        return thread

    def population_state(self) -> dict[str, Any]:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return self.population_state() if self.members else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = state_dict or None

    def fitness_of(self, result: Any) -> float:
        """A member's fitness from its evaluation episodes: accuracy or mean return, over every
        rank's episodes."""
        module = self.module
        if self.fitness_name.startswith("accuracy"):
            values = torch.tensor([episode_success(t) for t in result.trajectories])
        else:
            values = result.batch.returns.float().cpu()
        total = torch.stack([values.sum(), torch.tensor(float(len(values)))]).to(module.device)
        if module.world_size > 1:
            total = module.all_gather(total).sum(0)
        return float(total[0] / total[1].clamp(min=1))

    def mutated(
        self, hparams: dict[str, float], member_id: int, no_mutation_prob: float
    ) -> tuple[dict[str, float], str]:
        """:func:`mutate`, its result checked like a start-up value (a bad value never trains)."""
        hp, how = mutate(hparams, self.space, self.rng, no_mutation_prob, self.resample_prob)
        check_member(hp, self._algo, self.module.world_size, member_id)
        return hp, how

    def best_slot(self) -> int:
        scores = [m.fitness if m.fitness is not None else float("-inf") for m in self.members]
        return max(range(len(scores)), key=lambda i: (scores[i], -i))

    @torch.no_grad()
    def score(self, trainer: L.Trainer) -> list[float]:
        """Each member's fitness on the first ``eval_rows`` held-out rows (all ranks: the mean).

        Every member is scored at the same temperature (the config's rollout temperature, 0 for
        ``*_greedy``): a member's own mutated temperature would favour low ones for being
        evaluated at them."""
        rows, temperature = self.held_out(trainer)
        saved = rng_state.capture()  # scoring draws no numbers from training's streams
        results = self.member_results(rows, temperature)
        rng_state.restore(saved)
        return [self.fitness_of(result) for result in results]

    def member_results(self, rows: list[int], temperature: float) -> list[Any]:
        """Every member's evaluation episodes for ``rows``: round-robin, one member resident at
        a time (each swapped out is stored)."""
        module, out = self.module, []
        for slot in range(self.size):
            self.load(slot)
            params = dataclasses.replace(module.sampling, temperature=temperature)
            out.append(module.source.generate(rows, params, group_size=1, evaluation=True))
        return out

    def assign_fitness(self, fitness: list[float]) -> None:
        """Every member's fitness, scored now (at :attr:`steps`)."""
        for m, f in zip(self.members, fitness, strict=True):
            m.fitness = f
        self.scored_at = self.steps

    def evolve(self, trainer: L.Trainer) -> None:
        if self.multi_frequency is not None:
            self.evolve_subpopulations(trainer, self.multi_frequency)
            return
        fitness = self.score(trainer)  # scoring stored every member it swapped out; none trained since
        self.assign_fitness(fitness)
        step, best = trainer.global_step, self.best_slot()
        best_lr = float(self.members[best].hparams.get("lr", 0.0))
        if self.selection == "truncation":  # the least fit replaced, the rest kept as they are
            parents = truncation_select(fitness, self.rng, self.truncation)
            kept = {slot for slot, p in enumerate(parents) if p == slot}
        else:
            parents = tournament_select(fitness, self.rng, self.tournament_size, self.elitism)
            kept = {0} if self.elitism else set()
        new: list[Member] = []
        for slot, p in enumerate(parents):
            parent = self.members[p]
            if slot in kept:  # the same member, just scored: its fitness holds
                child, how = parent.clone(parent.id), "none"
                event = "elite" if self.selection == "tournament" else "kept"
                child.parent, child.fitness = parent.parent, parent.fitness
            else:
                child = parent.clone(self.next_id)
                self.next_id += 1
                child.hparams, how = self.mutated(parent.hparams, child.id, self.no_mutation_prob)
                event = "clone"
            new.append(child)
            self.record(step, slot, child, event, how, fitness[p])
        self.next_generation(trainer, new, parents, fitness, best_lr, {})

    def next_generation(
        self,
        trainer: L.Trainer,
        new: list[Member],
        parents: list[int],
        fitness: list[float],
        best_lr: float,
        extra: Mapping[str, float],
    ) -> None:
        """Put ``new`` (slot ``i``'s weights from the old slot ``parents[i]``) in place, check the
        ranks agree, log the scoring and write the lineage."""
        self.members = new
        self.place(parents)
        self.check_ranks_agree()
        shown = {
            "population/fitness_best": max(fitness),
            "population/fitness_mean": sum(fitness) / len(fitness),
            "population/best_lr": best_lr,  # the fittest member scored now
            **extra,
        }
        self.module.log_metrics({k: torch.tensor(float(v)) for k, v in shown.items()})
        self.write_lineage(trainer)

    def evolve_subpopulations(self, trainer: L.Trainer, schedule: MultiFrequency) -> None:
        """``population.schedule=mf_pbt``: after round ``steps // evolve_every`` the sub-populations
        due are ranked and evolve (:func:`~rlhf_lightning.population.multi_frequency.mf_pbt_plan`:
        losers take winners' clones, which explore; open slots take better members of the other
        sub-populations); every member is scored (the migration reads the global ranking), and
        nobody when no sub-population is due. Only the evolving slots get lineage rows."""
        round_ = self.steps // self.evolve_every
        if not evolving(round_, schedule.intervals):
            return
        fitness = self.score(trainer)
        self.assign_fitness(fitness)
        plan = mf_pbt_plan(round_, schedule, fitness, self.truncation)
        best_lr = float(self.members[self.best_slot()].hparams.get("lr", 0.0))
        due = {slot for j in plan.evolving for slot in schedule.slots(j)}
        new: list[Member] = []
        for slot in range(self.size):
            w, h = plan.weights_from[slot], plan.hparams_from[slot]
            old = self.members[w]
            if plan.kept(slot):  # the same member, just scored
                child = old.clone(old.id)
                child.parent, child.fitness = old.parent, old.fitness
                event, how = "kept", "none"
            else:
                child = old.clone(self.next_id)
                self.next_id += 1
                child.hparams = dict(self.members[h].hparams)
                if plan.explore[slot]:
                    child.hparams, how = self.mutated(child.hparams, child.id, self.no_mutation_prob)
                    event = "clone"
                else:
                    source = schedule.subpopulation(w)
                    what = (
                        "weights and hyper-parameters" if h == w else f"weights; hyper-parameters of slot {h}"
                    )
                    event, how = "migrant", f"from slot {w} (sub-population {source}): {what}"
            new.append(child)
            if slot in due:
                self.record(trainer.global_step, slot, child, event, how, fitness[w])
        extra = {
            "population/subpopulations_evolved": len(plan.evolving),
            "population/migrations": len(plan.migrations),
        }
        self.next_generation(trainer, new, list(plan.weights_from), fitness, best_lr, extra)

    def place(self, parents: list[int]) -> None:
        """Put the new generation (:attr:`members`, slot ``i`` born of the old slot
        ``parents[i]``) on the model. Round-robin: the members carry their copies; the model
        holds an old member's state, so the next one is loaded fresh."""
        self.resident = None
        self.load(self.steps % self.size)

    def member_digest(self, slot: int) -> list[float]:
        """What else of a member the ranks compare after selection (side by side: its weights)."""
        return []

    def digest_rows(self) -> torch.Tensor:
        """Per member: its id, its hyper-parameters and :meth:`member_digest` (float64)."""
        rows = [
            [float(m.id), *(float(m.hparams.get(k) or 0.0) for k in self.carried), *self.member_digest(i)]
            for i, m in enumerate(self.members)
        ]
        return torch.tensor(rows, dtype=torch.float64, device=self.module.device)

    def check_ranks_agree(self) -> None:
        """Every rank must hold the same population after selection (same seed, same gathered
        fitness): a cheap digest of ids and hyper-parameters (and :meth:`member_digest`) is
        compared across ranks."""
        module = self.module
        if module.world_size <= 1:
            return
        gathered = module.all_gather(self.digest_rows())
        if not bool((gathered == gathered[0]).all()):
            raise RuntimeError(
                f"population: ranks disagree after selection at step {self.steps}: {gathered.tolist()}"
            )

    def record(
        self, step: int, slot: int, member: Member | None, event: str, mutation: str, fitness: float | None
    ) -> None:
        m = member if member is not None else self.members[slot]
        row = {"step": step, "slot": slot, "id": m.id, "parent": m.parent, "event": event, "mutation": mutation,
               "parent_fitness": fitness, **{k: m.hparams.get(k) for k in self.carried}}  # fmt: skip
        self.lineage.append(row)

    def write_lineage(self, trainer: L.Trainer) -> None:
        if not trainer.is_global_zero:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        with (self.output_dir / "lineage.csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=[*LINEAGE_FIELDS, *self.carried[len(MUTABLE) :]])
            writer.writeheader()
            writer.writerows(self.lineage)
