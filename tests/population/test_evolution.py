"""Selection and mutation follow their rules: hand-checked examples for fixed seeds."""

from __future__ import annotations

import math
import random

import pytest

from rlhf_lightning.population.evolution import (
    MutationRange,
    mutate,
    sample_prior,
    tournament_select,
    truncation_select,
)


def test_tournament_with_elitism_by_hand():
    fitness = [0.1, 0.9, 0.5, 0.9]
    rng = random.Random(0)
    parents = tournament_select(fitness, rng, tournament_size=2, elitism=True)
    # Slot 0: the fittest, ties to the lowest index (1). Each other slot: the fitter of two members
    # drawn without replacement, replayed here from the same seed.
    replay = random.Random(0)
    expected = [1]
    for _ in range(3):
        a, b = replay.sample(range(4), 2)
        expected.append(max((a, b), key=lambda i: (fitness[i], -i)))
    assert parents == expected
    assert random.Random(0).sample(range(4), 2) == [3, 1]  # the first draw, written out: a tie
    assert parents[1] == 1  # 0.9 vs 0.9: the lower index wins


def test_tournament_of_the_whole_population_always_picks_the_best():
    assert tournament_select([0.3, 0.2, 0.7], random.Random(5), tournament_size=3, elitism=False) == [2, 2, 2]
    assert tournament_select([], random.Random(0)) == []


def test_mutation_by_hand():
    space = {"lr": MutationRange(1e-5, 1e-2, 2.0), "beta": MutationRange(0.0, 0.1, 1.5)}
    hp = {"lr": 1e-3, "beta": 0.0, "clip_low": 0.2}
    # Replay the draws: no-mutation coin, the name (sorted: beta, lr), the direction.
    rng, replay = random.Random(3), random.Random(3)
    out, how = mutate(hp, space, rng, no_mutation_prob=0.2)
    coin = replay.random()
    assert coin >= 0.2
    name = replay.choice(["beta", "lr"])
    up = replay.random() < 0.5
    if name == "lr":
        assert out["lr"] == pytest.approx(2e-3 if up else 5e-4)
        assert how == ("lr x2: 0.001 -> 0.002" if up else "lr /2: 0.001 -> 0.0005")
    else:  # beta is 0: up moves it to its low end (0), down divides 0
        assert out["beta"] == 0.0
    assert out["clip_low"] == 0.2 and hp["lr"] == 1e-3  # untouched keys; the input is not modified


def test_mutation_respects_bounds_integers_and_the_no_mutation_probability():
    space = {"group_size": MutationRange(2, 16, 2.0)}
    rng = random.Random(0)
    seen = set()
    for _ in range(200):
        out, _ = mutate({"group_size": 16}, space, rng, no_mutation_prob=0.0)
        assert out["group_size"] in (8, 16) and isinstance(out["group_size"], int)
        seen.add(out["group_size"])
    assert seen == {8, 16}  # up is clipped at 16
    unchanged = sum(mutate({"group_size": 4}, space, random.Random(i), 0.7)[1] == "none" for i in range(1000))
    assert 640 < unchanged < 760  # ~70%
    assert mutate({"lr": 1.0}, {}, random.Random(0), 0.0) == ({"lr": 1.0}, "none")
    with pytest.raises(ValueError):
        MutationRange(1.0, 0.5)


# ------------------------------------------------------------------ the prior, truncation, resampling
def test_members_drawn_from_the_prior_are_seeded_and_within_bounds():
    space = {
        "lr": MutationRange(1e-5, 1e-2, 2.0),  # log-uniform (lr's default prior)
        "temperature": MutationRange(0.5, 1.5, 1.2),  # uniform
        "group_size": MutationRange(2, 16, 2.0),  # uniform, an integer
    }
    base = {"lr": 1e-3, "temperature": 1.0, "group_size": 8, "clip_low": 0.2}
    draws = [sample_prior(base, space, random.Random(7))[0] for _ in range(2)]
    assert draws[0] == draws[1]  # the same seed, the same members
    rng = random.Random(0)
    many = [sample_prior(base, space, rng)[0] for _ in range(4000)]
    for hp in many:
        assert 1e-5 <= hp["lr"] <= 1e-2 and 0.5 <= hp["temperature"] <= 1.5
        assert isinstance(hp["group_size"], int) and 2 <= hp["group_size"] <= 16
        assert hp["clip_low"] == 0.2  # outside the space: the config's value
    # by hand, for the first draw: names in sorted order, each one draw of the RNG
    replay = random.Random(7)
    g = min(max(round(replay.uniform(2, 16)), 2), 16)
    lr = math.exp(replay.uniform(math.log(1e-5), math.log(1e-2)))
    t = replay.uniform(0.5, 1.5)
    assert (
        draws[0]["group_size"] == g and draws[0]["lr"] == pytest.approx(lr) and draws[0]["temperature"] == t
    )
    # log-uniform: each decade of [1e-5, 1e-2] gets a third of the draws; uniform: halves of [0.5, 1.5]
    decades = [sum(10**-k >= hp["lr"] > 10 ** -(k + 1) for hp in many) / len(many) for k in (2, 3, 4)]
    assert all(abs(d - 1 / 3) < 0.03 for d in decades), decades
    assert abs(sum(hp["temperature"] < 1.0 for hp in many) / len(many) - 0.5) < 0.03


def test_a_range_may_name_its_prior():
    r = MutationRange(0.01, 1.0, 2.0, prior="log")
    rng = random.Random(1)
    assert sum(r.draw("beta", rng) < 0.1 for _ in range(2000)) / 2000 == pytest.approx(0.5, abs=0.04)
    u = MutationRange(1e-5, 1e-2, 2.0, prior="uniform")
    assert sum(u.draw("lr", rng) < 5e-3 for _ in range(2000)) / 2000 == pytest.approx(0.5, abs=0.04)
    with pytest.raises(ValueError, match="prior"):
        MutationRange(0.0, 1.0, 2.0, prior="log")  # log needs low > 0
    with pytest.raises(ValueError, match="prior"):
        MutationRange(0.1, 1.0, 2.0, prior="normal")


def test_truncation_selection_by_hand():
    # 4 members, a quarter: the least fit (slot 0) takes a clone of the fittest (slot 1)
    assert truncation_select([0.1, 0.9, 0.5, 0.3], random.Random(0), 0.25) == [1, 1, 2, 3]
    # ties: the higher index counts as less fit
    assert truncation_select([0.5, 0.5, 0.5, 0.5], random.Random(0), 0.25) == [0, 1, 2, 0]
    # 8 members, a quarter: slots 2 and 5 (the two least fit) each draw one of the two fittest (7, 0)
    fitness = [0.8, 0.1, 0.0, 0.4, 0.5, 0.05, 0.3, 0.9]
    replay = random.Random(3)
    expected = list(range(8))
    for slot in (2, 5):
        expected[slot] = replay.choice([7, 0])
    assert truncation_select(fitness, random.Random(3), 0.25) == expected
    # at most half, at least one
    assert sum(p != i for i, p in enumerate(truncation_select([1, 2, 3, 4], random.Random(0), 0.5))) == 2
    assert truncation_select([0.2, 0.7], random.Random(0), 0.01) == [1, 1]
    assert truncation_select([0.2], random.Random(0), 0.25) == [0]


def test_a_clone_resamples_from_the_prior_when_told():
    space = {"lr": MutationRange(1e-5, 1e-2, 2.0)}
    rng = random.Random(4)
    out, how = mutate({"lr": 1e-3}, space, rng, no_mutation_prob=0.0, resample_prob=1.0)
    replay = random.Random(4)
    replay.random()  # the no-mutation coin
    replay.choice(["lr"])
    replay.random()  # the resample coin
    assert out["lr"] == pytest.approx(math.exp(replay.uniform(math.log(1e-5), math.log(1e-2))))
    assert how.startswith("lr resampled: 0.001 -> ")
    scaled, how = mutate({"lr": 1e-3}, space, random.Random(4), no_mutation_prob=0.0, resample_prob=0.0)
    assert scaled["lr"] in (2e-3, 5e-4) and ("x2" in how or "/2" in how)
