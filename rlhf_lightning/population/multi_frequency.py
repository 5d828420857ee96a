"""Multiple-frequencies population-based training (``population.schedule=mf_pbt``): the plan of
one evolution round as a pure function of the round, the schedule and the members' fitness.

Pinned to Doulazmi et al. 2025, "Multiple-Frequencies Population-Based Training" (MF-PBT,
arXiv 2506.03225, Section 3 and Algorithm 1; their code: ``hpo/utils/mf_pbt_genetics.py`` of
github.com/WaelDLZ/MF-PBT). Every rule below says where it comes from; where we simplify or
extend, it says so.

- **Sub-populations** (paper: the N agents split into M sub-populations P_1..P_M of N/M agents).
  Here the slots in order: sub-population ``j`` holds ``sizes[j]`` consecutive slots. Sizes may
  differ (ours: the paper takes them equal).
- **Frequencies** (paper: P_i evolves every delta_i x t_ready steps, 1 = delta_1 < delta_2 <
  ... < delta_M). Here a round is ``population.evolve_every`` steps and sub-population ``j``
  evolves after every ``intervals[j]``-th round (round r >= 1 with r % intervals[j] == 0; the
  paper's code: ``(round_index + 1) % freq == 0`` with rounds counted from 0). Intervals must
  rise strictly; the paper's first is 1, ours may be larger (a round with no sub-population due
  then scores nobody).
- **Brackets** (paper: an evolving sub-population's n agents ranked by fitness into quarters
  B1 winners, B2 survivors, B3 open for migration, B4 losers). Here the bracket size is
  ``k = max(1, floor(truncation x n))`` (``population.truncation``, default 0.25: the paper's
  quarter; its code floors, ``n // 4``), at most ``n // 2``: winners are ranks ``[0, k)``,
  losers the last ``k`` ranks and the open bracket ranks ``[2k, 3k)``. *Extension:* the paper's
  sub-populations have at least 4 agents; with 2 or 3 members (no room for a third bracket)
  the open bracket is shifted onto the losers, ranks ``[min(2k, n - k), min(3k, n))``, equal
  to the paper's whenever ``n >= 3k``.
- **Internal exploitation** (paper: every loser replaced by a clone of a winner, weights and
  hyper-parameters, then explored; winners and survivors kept). The paper's code pairs them by
  rank: the ``i``-th best loser gets the ``i``-th best winner; so here. Exploration is our
  :func:`~rlhf_lightning.population.evolution.mutate` (one value perturbed or resampled; the
  paper perturbs every searched value by 0.8 or 1.25: a simplification).
- **Migration** (paper: after exploitation, the open bracket of each evolving sub-population is
  offered to the best agents of the *other* sub-populations by the global ranking). Open slots
  are visited best first; the candidate is the best external agent not yet taken by this
  sub-population; it migrates in when it ranks above the slot's agent globally, else the slot
  keeps its agent and the next, worse, slot is offered the same candidate. *Extension:* a slot
  that is both open and a loser (n < 4) compares the candidate with the winner it would
  otherwise clone, so a migrant never displaces a better parent. Ranks are read before any
  change: two sub-populations evolving in the same round may take the same migrant.
- **Asymmetric transfer** (paper, Section 3.2: a migrant from a slower sub-population into a
  faster one is cloned in full, weights and hyper-parameters, to restore a collapsed faster
  sub-population's diversity; one from a faster into a slower one brings only its weights and
  takes the hyper-parameters of the receiving sub-population's best agent, so the long-horizon
  sub-populations inherit good weights but never a schedule tuned for the short term).
  Migrants are not explored. Migration goes both ways; only what travels differs. "Weights"
  here are the member's whole learned state (adapters, optimizer and schedule state, counters),
  as a clone's are.

Tie-breaking: equal fitness ranks the lower slot first (as
:func:`~rlhf_lightning.population.evolution.truncation_select`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MultiFrequency:
    """The sub-populations of ``population.schedule=mf_pbt``: ``sizes[j]`` consecutive slots
    each, evolving every ``intervals[j]`` rounds (strictly rising); ``migration=false`` drops
    migration (the paper's no-migration ablation)."""

    sizes: tuple[int, ...]
    intervals: tuple[int, ...]
    migration: bool = True

    def __post_init__(self) -> None:
        problem = schedule_problem(self.sizes, self.intervals)
        if problem is not None:
            raise ValueError(f"population.mf_pbt: {problem}")

    @classmethod
    def from_config(cls, size: int, node: Mapping[str, Any] | None) -> MultiFrequency:
        """``population.mf_pbt`` for a population of ``size``: sizes null splits it evenly."""
        node = dict(node or {})
        intervals = tuple(int(d) for d in node.get("intervals") or (1, 4))
        sizes = node.get("sizes")
        if sizes is None:
            if size % len(intervals):
                raise ValueError(
                    f"population.mf_pbt: population.size={size} does not split evenly into "
                    f"{len(intervals)} sub-populations; set population.mf_pbt.sizes"
                )
            sizes = [size // len(intervals)] * len(intervals)
        out = cls(tuple(int(n) for n in sizes), intervals, bool(node.get("migration", True)))
        if sum(out.sizes) != size:
            raise ValueError(f"population.mf_pbt.sizes={list(out.sizes)} must sum to population.size={size}")
        return out

    @property
    def size(self) -> int:
        return sum(self.sizes)

    def slots(self, j: int) -> range:
        """Sub-population ``j``'s slots."""
        start = sum(self.sizes[:j])
        return range(start, start + self.sizes[j])

    def subpopulation(self, slot: int) -> int:
        """The sub-population that holds ``slot``."""
        for j in range(len(self.sizes)):
            if slot in self.slots(j):
                return j
        raise IndexError(f"slot {slot} is outside a population of {self.size}")


def schedule_problem(sizes: Sequence[int], intervals: Sequence[int]) -> str | None:
    """Why these sub-population sizes and intervals cannot be a schedule, or None."""
    if len(intervals) < 2:
        return f"intervals={list(intervals)}: at least two sub-populations (one is plain PBT)"
    if any(d < 1 for d in intervals) or any(a >= b for a, b in itertools.pairwise(intervals)):
        return f"intervals={list(intervals)} must be integers >= 1, strictly rising (fastest first)"
    if len(sizes) != len(intervals):
        return f"sizes={list(sizes)} needs one size per interval ({len(intervals)})"
    if any(n < 2 for n in sizes):
        return f"sizes={list(sizes)}: each sub-population needs at least 2 members (a winner and a loser)"
    return None


def evolving(round_: int, intervals: Sequence[int]) -> list[int]:
    """The sub-populations that evolve after round ``round_`` (1, 2, ...): those whose interval
    divides it (paper: P_i every delta_i rounds)."""
    return [j for j, d in enumerate(intervals) if round_ >= 1 and round_ % d == 0]


def evolving_slots(step: int, evolve_every: int, schedule: MultiFrequency) -> list[int]:
    """The slots that evolve at ``step`` (a count of the population's steps; rounds are
    ``evolve_every`` of them): none between rounds."""
    if evolve_every <= 0 or step <= 0 or step % evolve_every:
        return []
    return [s for j in evolving(step // evolve_every, schedule.intervals) for s in schedule.slots(j)]


@dataclass(frozen=True)
class Brackets:
    """Ranks (0: the fittest) of one sub-population's brackets."""

    winners: range
    open: range
    losers: range


def brackets(n: int, truncation: float = 0.25) -> Brackets:
    """Winners ``[0, k)``, the open bracket and the last ``k`` losers of a sub-population of
    ``n``, ``k = max(1, floor(truncation x n))`` capped at ``n // 2`` (module docstring)."""
    k = min(max(1, math.floor(truncation * n + 1e-9)), n // 2)
    return Brackets(range(k), range(min(2 * k, n - k), min(3 * k, n)), range(n - k, n))


def ranking(fitness: Sequence[float], slots: Sequence[int]) -> list[int]:
    """``slots`` fittest first (ties: the lower slot)."""
    return sorted(slots, key=lambda s: (-fitness[s], s))


@dataclass(frozen=True)
class Plan:
    """One round's decisions, by slot of the new generation: the old slot its weights (its
    whole learned state) come from, the old slot its hyper-parameters come from, whether those
    are explored (mutated); the sub-populations that evolved and the migrations (slot, from)."""

    evolving: tuple[int, ...]
    weights_from: tuple[int, ...]
    hparams_from: tuple[int, ...]
    explore: tuple[bool, ...]
    migrations: tuple[tuple[int, int], ...]

    def kept(self, slot: int) -> bool:
        return self.weights_from[slot] == slot and self.hparams_from[slot] == slot


def mf_pbt_plan(
    round_: int, schedule: MultiFrequency, fitness: Sequence[float], truncation: float = 0.25
) -> Plan:
    """The MF-PBT evolution after round ``round_`` (module docstring): internal exploitation in
    every evolving sub-population, then migration into their open brackets."""
    n = schedule.size
    if len(fitness) != n:
        raise ValueError(f"{len(fitness)} fitness values for a population of {n}")
    weights, hparams, explore = list(range(n)), list(range(n)), [False] * n
    now = evolving(round_, schedule.intervals)
    order = ranking(fitness, range(n))
    position = {slot: r for r, slot in enumerate(order)}  # global rank, read before any change
    local = {j: ranking(fitness, schedule.slots(j)) for j in now}
    for j in now:  # internal exploitation: the i-th best loser takes the i-th best winner
        b = brackets(len(local[j]), truncation)
        for w, loser in zip(b.winners, b.losers, strict=True):
            slot = local[j][loser]
            weights[slot] = hparams[slot] = local[j][w]
            explore[slot] = True
    migrations: list[tuple[int, int]] = []
    for j in now if schedule.migration else []:
        external = [s for s in order if schedule.subpopulation(s) != j]
        for r in brackets(len(local[j]), truncation).open:
            slot = local[j][r]
            if not external:
                break
            migrant, otherwise = external[0], weights[slot]
            if position[migrant] >= position[otherwise]:
                continue  # the slot keeps what it holds; the next slot gets the same offer
            external.pop(0)
            weights[slot], explore[slot] = migrant, False
            slower = schedule.intervals[schedule.subpopulation(migrant)] > schedule.intervals[j]
            hparams[slot] = migrant if slower else local[j][0]
            migrations.append((slot, migrant))
    return Plan(tuple(now), tuple(weights), tuple(hparams), tuple(explore), tuple(migrations))
