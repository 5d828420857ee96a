"""Population training (``population.size=N``): N members on one frozen base, evolved in one run.

A member is the trainable weights (actor adapter, and PPO's critic adapter and value head), its
own reference adapter when the reference moves (``algo.ref_update_interval``), its optimizer and
scheduler state, the module's per-member counters (PPO's critic warm-up) and its
hyper-parameters. One member at a time is *resident*: its weights sit in the policy's adapter
slots, its state in Lightning's optimizer and scheduler, its hyper-parameters in ``module.hp``
and ``module.sampling``. The others are copies off the model (a few adapters' memory, never N
models). Training steps go round-robin over the members (the trainer's optimizer steps count
them all; each member's warm-up and cosine schedule spans its own share of them). Every
``population.evolve_every`` steps each member is scored on a held-out slice at one sampling
temperature, then tournament selection with elitism picks each slot's parent, the parent is
cloned (weights and optimizer state copied, the base untouched) and mutated, every mutated
value checked like a start-up value; ``lineage.csv`` records every birth. Validation and the
final export use the fittest member.
"""

from __future__ import annotations

import copy
import csv
import dataclasses
import functools
import random
import threading
from pathlib import Path
from typing import Any, cast

import lightning as L
import torch

from rlhf_lightning.algorithms.evaluation import episode_success
from rlhf_lightning.algorithms.records import StepSummary
from rlhf_lightning.population.checks import check_member, validate_space
from rlhf_lightning.population.evolution import MUTABLE, MutationRange, mutate, tournament_select
from rlhf_lightning.population.members import KEEP_SNAPSHOTS, Member, copy_into, write_snapshot
from rlhf_lightning.runtime import rng as rng_state
from rlhf_lightning.runtime.schedule import warmup_cosine

FITNESS = ("accuracy_sampled", "accuracy_greedy", "return_sampled", "return_greedy")
LINEAGE_FIELDS = ["step", "slot", "id", "parent", "event", "mutation", "parent_fitness", *MUTABLE]
MEMBER_COUNTERS = ("learn_steps",)  # module attributes each member carries (PPO's critic warm-up)


class Population(L.Callback):
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
    ) -> None:
        if size < 2:
            raise ValueError(f"population.size must be at least 2, got {size}")
        if evolve_every < 0 or (evolve_every and evolve_every % size):
            raise ValueError(
                f"population.evolve_every={evolve_every}: a multiple of population.size={size}, or 0"
            )
        if fitness not in FITNESS:
            raise ValueError(f"population.fitness={fitness!r}: one of {', '.join(FITNESS)}")
        unknown = sorted(set(space) - set(MUTABLE))
        if unknown:
            raise ValueError(f"population.mutate: unknown hyper-parameters {unknown}; choose among {MUTABLE}")
        if keep_snapshots < 1:
            raise ValueError(f"population.keep_snapshots must be at least 1, got {keep_snapshots}")
        self.size, self.evolve_every, self.space = size, evolve_every, dict(space)
        self.fitness_name, self.eval_rows = fitness, eval_rows
        self.tournament_size, self.elitism, self.no_mutation_prob = tournament_size, elitism, no_mutation_prob
        self.mutate_initial, self.snapshot_every = mutate_initial, snapshot_every
        self.keep_snapshots = keep_snapshots
        self.output_dir = Path(output_dir)
        self.rng = random.Random(seed)
        self.members: list[Member] = []
        self.resident: int | None = None  # the slot whose state is on the model
        self.steps = 0  # training steps taken by all members together
        self.next_id = 0
        self.lineage: list[dict[str, Any]] = []
        self.snapshots: list[threading.Thread] = []
        self.module: Any = None
        self._base_hp: Any = None
        self._base_temperature = 1.0
        self._ref_interval: int | None = None  # members' own references move every this many updates
        self._algo: dict[str, Any] = {}  # the algorithm's config values (mutated values are checked)
        self._restored: dict[str, Any] | None = None

    # ------------------------------------------------------------------ the resident member
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

    def counters(self) -> dict[str, int]:
        return {k: int(getattr(self.module, k)) for k in MEMBER_COUNTERS if hasattr(self.module, k)}

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
        for name, value in m.counters.items():
            setattr(self.module, name, value)
        self.optimizer().load_state_dict(m.optimizer)
        sched = self.scheduler()
        sched.load_state_dict(m.scheduler)
        self.apply_hparams(m.hparams)
        self.resident = slot
        if self.module.engine is not None:
            self.module.engine.invalidate()  # another member's weights: the engine syncs before sampling

    def apply_hparams(self, hp: dict[str, float]) -> None:
        module = self.module
        fields = {f.name for f in dataclasses.fields(self._base_hp)}
        algo: dict[str, Any] = {k: v for k, v in hp.items() if k in fields and k != "temperature"}
        if self._ref_interval:  # the population refreshes each member's own reference (refresh_reference)
            algo["ref_update_interval"] = None
        module.hp = dataclasses.replace(self._base_hp, **algo)
        module.sampling = dataclasses.replace(
            module.sampling, temperature=hp.get("temperature", self._base_temperature)
        )
        sched, opt = self.scheduler(), self.optimizer()
        lrs = [hp.get("lr", self._base_hp.lr)] * len(opt.param_groups)
        critic_lr = getattr(self._base_hp, "lr_critic", None)
        if critic_lr is not None and len(lrs) > 1:
            lrs[1] = critic_lr  # PPO's critic keeps its own configured lr
        sched.base_lrs = list(lrs)
        for group, base, fn in zip(opt.param_groups, lrs, sched.lr_lambdas):
            group["initial_lr"] = base
            group["lr"] = base * fn(sched.last_epoch)
        module.objective = module.build_objective()

    def initial_hparams(self) -> dict[str, float]:
        hp = {k: getattr(self._base_hp, k) for k in MUTABLE if hasattr(self._base_hp, k)}
        hp["temperature"] = self._base_temperature
        return {k: v for k, v in hp.items() if v is not None}

    def mutated(
        self, hparams: dict[str, float], member_id: int, no_mutation_prob: float
    ) -> tuple[dict[str, float], str]:
        """:func:`mutate`, its result checked like a start-up value (a bad value never trains)."""
        hp, how = mutate(hparams, self.space, self.rng, no_mutation_prob)
        check_member(hp, self._algo, self.module.world_size, member_id)
        return hp, how

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

    # ------------------------------------------------------------------ Lightning hooks
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        module: Any = pl_module
        self.module = module
        self._base_hp = module.hp
        self._base_temperature = float(module.sampling.temperature)
        self._ref_interval = getattr(self._base_hp, "ref_update_interval", None) or None
        self._algo = dataclasses.asdict(self._base_hp)
        finetune = "lora" if module.policy.is_peft else "full"
        space = {name: dataclasses.asdict(r) for name, r in self.space.items()}
        validate_space(space, self._algo, finetune, module.world_size)  # as at start-up
        # Each member's warm-up and cosine run over its own share of the optimizer steps.
        hp, sched = self._base_hp, self.scheduler()
        own = max(module.total_optimizer_steps() // self.size, 1)
        schedule = functools.partial(
            warmup_cosine, warmup_steps=hp.warmup_steps, total_steps=own, min_lr_ratio=hp.min_lr_ratio
        )
        sched.lr_lambdas = [schedule] * len(sched.lr_lambdas)
        if self._restored is not None:  # a resume: the checkpoint's population
            self._load_population(self._restored)
            self._restored = None
            return
        base = self.initial_hparams()
        for slot in range(self.size):
            hp, how = (
                self.mutated(base, self.next_id, 0.0) if self.mutate_initial and slot else (base, "none")
            )
            self.members.append(self.capture(self.next_id, hp))
            self.record(trainer.global_step, slot, None, "init", how, None)
            self.next_id += 1
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

    def maybe_snapshot(self, trainer: L.Trainer) -> threading.Thread | None:
        """Every ``snapshot_every`` steps, rank 0 writes the population (every rank holds the same)."""
        if not self.snapshot_every or self.steps % self.snapshot_every or not trainer.is_global_zero:
            return None
        return self.snapshot(self.output_dir / "population" / f"snapshot_step_{self.steps:06d}.pt")

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.members:
            self.load(self.best_slot())

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for t in self.snapshots:
            t.join()
        if not self.members:
            return
        self.load(self.best_slot())
        if trainer.is_global_zero:
            out = self.module.policy.save_adapter(self.output_dir / "population" / "best")
            if out is not None:
                m = self.members[self.best_slot()]
                print(f"population: best member {m.id} (fitness {m.fitness}) -> {out}")

    # ------------------------------------------------------------------ evolution
    def best_slot(self) -> int:
        scores = [m.fitness if m.fitness is not None else float("-inf") for m in self.members]
        return max(range(len(scores)), key=lambda i: (scores[i], -i))

    @torch.no_grad()
    def score(self, trainer: L.Trainer) -> list[float]:
        """Each member's fitness on the first ``eval_rows`` held-out rows (all ranks: the mean).

        Every member is scored at the same temperature (the config's rollout temperature, 0 for
        ``*_greedy``): a member's own mutated temperature would favour low ones for being
        evaluated at them."""
        module = self.module
        dm = trainer.datamodule  # type: ignore[attr-defined]
        n = min(self.eval_rows, dm.eval_rows)
        rows = list(range(module.rank, n, module.world_size))
        temperature = self._base_temperature if self.fitness_name.endswith("_sampled") else 0.0
        saved = rng_state.capture()  # scoring draws no numbers from training's streams
        out = []
        for slot in range(self.size):
            self.load(slot)
            params = dataclasses.replace(module.sampling, temperature=temperature)
            result = module.rollout(rows, params, group_size=1, evaluation=True)
            if self.fitness_name.startswith("accuracy"):
                values = torch.tensor([episode_success(t) for t in result.trajectories])
            else:
                values = result.batch.returns.float().cpu()
            total = torch.stack([values.sum(), torch.tensor(float(len(values)))]).to(module.device)
            if module.world_size > 1:
                total = module.all_gather(total).sum(0)
            out.append(float(total[0] / total[1].clamp(min=1)))
        rng_state.restore(saved)
        return out

    def evolve(self, trainer: L.Trainer) -> None:
        fitness = self.score(trainer)  # scoring stored every member it swapped out; none trained since
        for m, f in zip(self.members, fitness):
            m.fitness = f
        step, best = trainer.global_step, self.best_slot()
        best_lr = float(self.members[best].hparams.get("lr", 0.0))
        parents = tournament_select(fitness, self.rng, self.tournament_size, self.elitism)
        new: list[Member] = []
        for slot, p in enumerate(parents):
            parent = self.members[p]
            if slot == 0 and self.elitism:
                child, event, how = parent.clone(parent.id), "elite", "none"
                child.parent = parent.parent
            else:
                child = parent.clone(self.next_id)
                self.next_id += 1
                child.hparams, how = self.mutated(parent.hparams, child.id, self.no_mutation_prob)
                event = "clone"
            new.append(child)
            self.record(step, slot, child, event, how, fitness[p])
        self.members = new
        self.check_ranks_agree()
        self.resident = None  # the model holds an old member's state: load the next one fresh
        self.load(self.steps % self.size)
        self.module.log_metrics(
            {
                "population/fitness_best": torch.tensor(max(fitness)),
                "population/fitness_mean": torch.tensor(sum(fitness) / len(fitness)),
                "population/best_lr": torch.tensor(best_lr),  # the fittest member scored now
            }
        )
        self.write_lineage(trainer)

    def check_ranks_agree(self) -> None:
        """Every rank must hold the same population after selection (same seed, same gathered
        fitness): a cheap digest of ids and hyper-parameters is compared across ranks."""
        module = self.module
        if module.world_size <= 1:
            return
        digest = torch.tensor(
            [[float(m.id), *(float(m.hparams.get(k) or 0.0) for k in MUTABLE)] for m in self.members],
            dtype=torch.float64,
            device=module.device,
        )
        gathered = module.all_gather(digest)
        if not bool((gathered == gathered[0]).all()):
            raise RuntimeError(
                f"population: ranks disagree after selection at step {self.steps}: {gathered.tolist()}"
            )

    def record(
        self, step: int, slot: int, member: Member | None, event: str, mutation: str, fitness: float | None
    ) -> None:
        m = member if member is not None else self.members[slot]
        row = {"step": step, "slot": slot, "id": m.id, "parent": m.parent, "event": event, "mutation": mutation,
               "parent_fitness": fitness, **{k: m.hparams.get(k) for k in MUTABLE}}  # fmt: skip
        self.lineage.append(row)

    def write_lineage(self, trainer: L.Trainer) -> None:
        if not trainer.is_global_zero:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        with (self.output_dir / "lineage.csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=LINEAGE_FIELDS)
            writer.writeheader()
            writer.writerows(self.lineage)

    # ------------------------------------------------------------------ state: checkpoints and snapshots
    def population_state(self) -> dict[str, Any]:
        """Copies of everything that decides the population's future (members, RNG, counters)."""
        self.store()
        return {
            "members": [dataclasses.asdict(m) for m in self.members],  # deep copies
            "resident": self.resident,
            "steps": self.steps,
            "next_id": self.next_id,
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
        path.parent.mkdir(parents=True, exist_ok=True)
        self.snapshots = [t for t in self.snapshots if t.is_alive()]
        thread = threading.Thread(
            target=write_snapshot, args=(state, path, self.keep_snapshots), daemon=False
        )
        thread.start()
        self.snapshots.append(thread)
        return thread

    def state_dict(self) -> dict[str, Any]:
        return self.population_state() if self.members else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = state_dict or None

    def _load_population(self, state: dict[str, Any]) -> None:
        self.members = [Member(**m) for m in state["members"]]
        shared = [p.detach().clone() for p in self.reference_params()]
        for m in self.members:  # a checkpoint from before members had their own: the shared one
            m.reference = m.reference or [w.clone() for w in shared]
        self.steps, self.next_id = state["steps"], state["next_id"]
        self.rng.setstate(state["rng"])
        self.lineage = [dict(r) for r in state["lineage"]]
        # Lightning restored the resident's weights, optimizer and scheduler; its hyper-parameters:
        self.resident = state["resident"]
        if self.resident is not None:
            self.apply_hparams(self.members[self.resident].hparams)
