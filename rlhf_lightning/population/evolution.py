"""Evolution of a population's hyper-parameters: the first members drawn from the mutation
space's prior (as a search draws its trials), truncation or tournament selection, and
exploration by perturbing a value or resampling it from the prior.

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
# or, for ``temperature``, to the sampling parameters. ``min_lr_ratio`` (where the member's cosine
# schedule ends, a share of its lr) shapes the schedule it follows from its current position on.
MUTABLE = ("lr", "clip_low", "clip_high", "beta", "temperature", "group_size", "entropy_coef", "min_lr_ratio")
# ... and any parameter of the configured loss or advantage estimator that has no flat field, by
# its node path (``loss.<param>``, ``advantage.<param>``): a function from outside the package.
NODE_PREFIXES = ("loss.", "advantage.")
FITNESS = ("accuracy_sampled", "accuracy_greedy", "return_sampled", "return_greedy")  # population.fitness
SELECTION = ("truncation", "tournament")  # population.selection
INIT = ("sample", "config")  # population.init
SCHEDULES = ("pbt", "mf_pbt")  # population.schedule
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
    then kept within ``[low, high]``. A value of 0 moves to ``low`` on the way up.

    ``prior``: how a value is drawn from the range (``population.init=sample`` and resampling):
    ``log`` (log-uniform; needs ``low > 0``) or ``uniform``; None: ``log`` for ``lr``,
    ``uniform`` for the rest."""

    low: float
    high: float
    scale: float = 1.5
    prior: str | None = None

    def __post_init__(self) -> None:
        if not (0 <= self.low <= self.high) or self.scale <= 1.0:
            raise ValueError(f"a mutation range needs 0 <= low <= high and scale > 1, got {self}")
        if self.prior not in (None, "log", "uniform") or (self.prior == "log" and self.low <= 0):
            raise ValueError(f"a mutation range's prior is log (with low > 0), uniform or null, got {self}")

    def draw(self, name: str, rng: random.Random) -> float:
        """A value from the prior (an integer for :data:`INTEGER` names)."""
        log = self.prior == "log" or (self.prior is None and name == "lr" and self.low > 0)
        if log:
            value = math.exp(rng.uniform(math.log(self.low), math.log(self.high)))
        else:
            value = rng.uniform(self.low, self.high)
        if name in INTEGER:
            value = float(min(max(round(value), math.ceil(self.low)), math.floor(self.high)))
        return min(max(value, self.low), self.high)


def sample_prior(
    hparams: dict[str, float], space: dict[str, MutationRange], rng: random.Random
) -> tuple[dict[str, float], str]:
    """A copy of ``hparams`` with every name of ``space`` (sorted) drawn from its prior, and a
    description (``"sampled lr=0.0003, temperature=0.9"``): a member's start with
    ``population.init=sample``, as a search samples a trial."""
    out = dict(hparams)
    for name in sorted(space):
        value = space[name].draw(name, rng)
        out[name] = int(value) if name in INTEGER else value
    return out, "sampled " + ", ".join(f"{n}={out[n]:.4g}" for n in sorted(space))


def truncation_select(fitness: Sequence[float], rng: random.Random, fraction: float = 0.25) -> list[int]:
    """Parents of the next generation (PBT's truncation selection, Jaderberg et al. 2017): the
    ``ceil(fraction * n)`` least fit members (ties: the higher index) are replaced by clones of
    members drawn uniformly from as many fittest ones; every other slot keeps its member
    (``parents[i] == i``). At most half the members are replaced."""
    n = len(fitness)
    if n < 2:
        return list(range(n))
    k = min(max(1, math.ceil(fraction * n)), n // 2)
    order = sorted(range(n), key=lambda i: (fitness[i], -i), reverse=True)  # fittest first
    top, bottom = order[:k], order[n - k :]
    parents = list(range(n))
    for slot in sorted(bottom):
        parents[slot] = rng.choice(top)
    return parents


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
    resample_prob: float = 0.0,
) -> tuple[dict[str, float], str]:
    """A copy of ``hparams`` with at most one hyper-parameter of ``space`` changed, and a
    description (``"none"``, e.g. ``"lr x2: 0.001 -> 0.002"``, or ``"lr resampled: 0.001 ->
    0.0004"``; a bound may stop the change).

    With probability ``no_mutation_prob`` nothing changes; otherwise one name of ``space``
    (sorted, drawn uniformly) is, with probability ``resample_prob``, drawn afresh from its
    prior (:meth:`MutationRange.draw`), else multiplied or divided by its scale and clipped to
    its range.
    """
    out = dict(hparams)
    if not space or rng.random() < no_mutation_prob:
        return out, "none"
    name = rng.choice(sorted(space))
    r = space[name]
    if resample_prob > 0 and rng.random() < resample_prob:
        old = float(out[name])
        new_value = r.draw(name, rng)
        out[name] = int(new_value) if name in INTEGER else new_value
        return out, f"{name} resampled: {old:g} -> {out[name]:g}"
    up = rng.random() < 0.5
    value = float(out[name])
    new = (value * r.scale if value > 0 else r.low) if up else value / r.scale
    new = min(max(new, r.low), r.high)
    if name in INTEGER:
        new = float(max(round(new), math.ceil(r.low)))
    out[name] = int(new) if name in INTEGER else new
    return out, f"{name} {'x' if up else '/'}{r.scale:g}: {value:g} -> {out[name]:g}"
