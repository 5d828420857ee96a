"""Selection and mutation follow their rules: hand-checked examples for fixed seeds."""

from __future__ import annotations

import random

import pytest

from rlhf_lightning.population.evolution import MutationRange, mutate, tournament_select


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
