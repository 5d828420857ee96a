"""Evolution of a population's hyper-parameters: tournament selection with elitism, mutation.

Pure functions of their inputs and a ``random.Random``: every rank draws the same decisions from
the same seed, and a test can check an example by hand.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Hyper-parameters a member may carry: each is applied to the algorithm's config (``algo.<name>``)
# or, for ``temperature``, to the sampling parameters.
MUTABLE = ("lr", "clip_low", "clip_high", "beta", "temperature", "group_size", "entropy_coef")
# ... and any parameter of the configured loss or advantage estimator that has no flat field, by
# its node path (``loss.<param>``, ``advantage.<param>``): a function from outside the package.
NODE_PREFIXES = ("loss.", "advantage.")
FITNESS = ("accuracy_sampled", "accuracy_greedy", "return_sampled", "return_greedy")  # population.fitness
INTEGER = ("group_size",)
DEFAULT_SPACE = {"lr": {"low": 1e-6, "high": 1e-2, "scale": 2.0}}  # population.mutate=null


def is_mutable(name: str) -> bool:
    """Whether ``name`` is a hyper-parameter a member may carry (:data:`MUTABLE` or a node path)."""
    return name in MUTABLE or (name.startswith(NODE_PREFIXES) and name.count(".") == 1)


def flat_space(mutate: Mapping[str, Any]) -> dict[str, Any]:
    """``population.mutate`` with node paths flattened: ``{loss: {scale: {low, high}}}`` (as the
    command line's ``+population.mutate.loss.scale.low=...`` writes it) becomes ``{"loss.scale":
    {low, high}}``; a range (a mapping with ``low``) is kept as it is."""
    out: dict[str, Any] = {}
    for name, r in mutate.items():
        if isinstance(r, Mapping) and "low" not in r and all(isinstance(v, Mapping) for v in r.values()):
            out.update({f"{name}.{p}": v for p, v in r.items()})
        else:
            out[str(name)] = r
    return out


@dataclass(frozen=True)
class MutationRange:
    """How one hyper-parameter mutates: multiplied by ``scale`` or divided by it (equally likely),
    then kept within ``[low, high]``. A value of 0 moves to ``low`` on the way up."""

    low: float
    high: float
    scale: float = 1.5

    def __post_init__(self) -> None:
        if not (0 <= self.low <= self.high) or self.scale <= 1.0:
            raise ValueError(f"a mutation range needs 0 <= low <= high and scale > 1, got {self}")


def tournament_select(
    fitness: Sequence[float], rng: random.Random, tournament_size: int = 2, elitism: bool = True
) -> list[int]:
    """Parents of the next generation, one per slot (as many as ``fitness``).

    With ``elitism`` slot 0 gets the fittest member (ties: the lowest index); every other slot
    gets the winner of a tournament among ``tournament_size`` members drawn without replacement
    (the fittest of them, ties: the lowest index).
    """
    n = len(fitness)
    if n == 0:
        return []
    k = max(1, min(tournament_size, n))
    best = max(range(n), key=lambda i: (fitness[i], -i))
    parents = [best] if elitism else []
    while len(parents) < n:
        entrants = rng.sample(range(n), k)
        parents.append(max(entrants, key=lambda i: (fitness[i], -i)))
    return parents


def mutate(
    hparams: dict[str, float],
    space: dict[str, MutationRange],
    rng: random.Random,
    no_mutation_prob: float = 0.2,
) -> tuple[dict[str, float], str]:
    """A copy of ``hparams`` with at most one hyper-parameter of ``space`` changed, and a
    description (``"none"``, or e.g. ``"lr x2: 0.001 -> 0.002"``; a bound may stop the change).

    With probability ``no_mutation_prob`` nothing changes; otherwise one name of ``space``
    (sorted, drawn uniformly) is multiplied or divided by its scale and clipped to its range.
    """
    out = dict(hparams)
    if not space or rng.random() < no_mutation_prob:
        return out, "none"
    name = rng.choice(sorted(space))
    r = space[name]
    up = rng.random() < 0.5
    value = float(out[name])
    new = (value * r.scale if value > 0 else r.low) if up else value / r.scale
    new = min(max(new, r.low), r.high)
    if name in INTEGER:
        new = float(max(round(new), math.ceil(r.low)))
    out[name] = int(new) if name in INTEGER else new
    return out, f"{name} {'x' if up else '/'}{r.scale:g}: {value:g} -> {out[name]:g}"
