"""population.schedule=mf_pbt (multiple-frequencies PBT, Doulazmi et al. 2025): which members
evolve when, the brackets, internal exploitation and asymmetric migration, each by hand; a
member's own ``min_lr_ratio``; and a 2-step run whose lineage follows the schedule."""

from __future__ import annotations

import csv
import math

import pytest
import torch

from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.learner.optimizer import set_base_lrs
from rlhf_lightning.population.checks import value_problem
from rlhf_lightning.population.generations import Generations
from rlhf_lightning.population.members import follow_schedule
from rlhf_lightning.population.multi_frequency import (
    MultiFrequency,
    brackets,
    evolving,
    evolving_slots,
    mf_pbt_plan,
)
from rlhf_lightning.population.side_by_side import SideBySidePopulation
from rlhf_lightning.run import run
from rlhf_lightning.run.validation import validate
from tests.conftest import FAST, compose_config

TWO_BY_FOUR = MultiFrequency(sizes=(4, 4), intervals=(1, 3))


def test_which_members_evolve_at_each_step():
    """Rounds of 10 steps; sub-population 0 (slots 0-3) every round, 1 (slots 4-7) every third."""
    fast, slow = [0, 1, 2, 3], [4, 5, 6, 7]
    table = {0: [], 5: [], 10: fast, 15: [], 20: fast, 30: fast + slow, 40: fast, 50: fast, 60: fast + slow}
    for step, slots in table.items():
        assert evolving_slots(step, 10, TWO_BY_FOUR) == slots, step
    assert [evolving(r, (1, 3)) for r in range(7)] == [[], [0], [0], [0, 1], [0], [0], [0, 1]]
    assert [evolving(r, (2, 5)) for r in (1, 2, 5, 10)] == [[], [0], [1], [0, 1]]
    assert evolving_slots(30, 0, TWO_BY_FOUR) == []  # never evolving


def test_brackets_by_hand():
    """(winners, open, losers) ranks: the paper's quarters from 4 members on, and the open
    bracket shifted onto the losers below 4."""
    table = {
        (2, 0.25): ([0], [1], [1]),
        (3, 0.25): ([0], [2], [2]),
        (4, 0.25): ([0], [2], [3]),
        (6, 0.25): ([0], [2], [5]),
        (8, 0.25): ([0, 1], [4, 5], [6, 7]),
        (4, 0.5): ([0, 1], [2, 3], [2, 3]),
    }
    for (n, truncation), (winners, open_, losers) in table.items():
        b = brackets(n, truncation)
        assert (list(b.winners), list(b.open), list(b.losers)) == (winners, open_, losers), n


def test_a_fast_round_exploits_and_takes_a_slower_migrant_in_full():
    # slot:    0     1     2     3     4     5     6     7
    fitness = [0.50, 0.10, 0.30, 0.20, 0.60, 0.05, 0.40, 0.35]
    plan = mf_pbt_plan(1, TWO_BY_FOUR, fitness)
    # Sub-population 0 ranks 0, 2, 3, 1: winner 0, open slot 3, loser 1. The loser takes a clone
    # of the winner (explored). The best outsider, slot 4 (0.60, first globally), beats slot 3
    # (0.20) and comes from the slower sub-population: weights and hyper-parameters, unexplored.
    assert plan.evolving == (0,)
    assert plan.weights_from == (0, 0, 2, 4, 4, 5, 6, 7)
    assert plan.hparams_from == (0, 0, 2, 4, 4, 5, 6, 7)
    assert plan.explore == (False, True, False, False, False, False, False, False)
    assert plan.migrations == ((3, 4),)
    assert [s for s in range(8) if plan.kept(s)] == [0, 2, 4, 5, 6, 7]


def test_a_slow_round_takes_a_faster_migrants_weights_and_its_own_best_hparams():
    fitness = [0.50, 0.10, 0.30, 0.20, 0.60, 0.05, 0.40, 0.35]
    plan = mf_pbt_plan(3, TWO_BY_FOUR, fitness)
    # Both evolve. Sub-population 1 ranks 4, 6, 7, 5: loser 5 takes 4; the open slot 7 (0.35,
    # fourth globally) is offered slot 0 (0.50, second): it takes slot 0's weights, and from a
    # faster sub-population only those: its hyper-parameters are its own best's, slot 4's.
    # The same round, sub-population 0 takes slot 4 as before (ranks read before any change).
    assert plan.evolving == (0, 1)
    assert plan.weights_from == (0, 0, 2, 4, 4, 4, 6, 0)
    assert plan.hparams_from == (0, 0, 2, 4, 4, 4, 6, 4)
    assert plan.explore == (False, True, False, False, False, True, False, False)
    assert plan.migrations == ((3, 4), (7, 0))


def test_a_migrant_that_ranks_below_the_open_slot_stays_home():
    fitness = [0.1, 0.2, 0.3, 0.4, 0.9, 0.8, 0.7, 0.6]
    plan = mf_pbt_plan(3, TWO_BY_FOUR, fitness)
    # Sub-population 0 ranks 3, 2, 1, 0: loser 0 takes 3, open slot 1 takes slot 4 (0.9 > 0.2).
    # Sub-population 1 ranks 4, 5, 6, 7: loser 7 takes 4; its open slot 6 (0.7) is offered slot
    # 3 (0.4, the best outsider): no migration.
    assert plan.weights_from == (3, 4, 2, 3, 4, 5, 6, 4)
    assert plan.hparams_from == (3, 4, 2, 3, 4, 5, 6, 4)
    assert plan.migrations == ((1, 4),)
    no_migration = mf_pbt_plan(3, MultiFrequency((4, 4), (1, 3), migration=False), fitness)
    assert no_migration.weights_from == (3, 1, 2, 3, 4, 5, 6, 4) and no_migration.migrations == ()


def test_two_member_subpopulations_take_a_migrant_only_above_their_winner():
    schedule = MultiFrequency(sizes=(2, 2), intervals=(1, 2))
    # global ranking 1, 2, 3, 0: the loser 0 would clone 1 (first globally): the outsider 2 is
    # worse, so slot 0 is an explored clone of 1
    plan = mf_pbt_plan(1, schedule, [0.2, 0.5, 0.4, 0.3])
    assert (plan.weights_from, plan.explore, plan.migrations) == (
        (1, 1, 2, 3),
        (True, False, False, False),
        (),
    )
    # global ranking 2, 3, 1, 0: the outsider 2 ranks above the winner 1: slot 0 takes slot 2 in
    # full (from the slower sub-population), unexplored
    plan = mf_pbt_plan(1, schedule, [0.2, 0.3, 0.5, 0.4])
    assert plan.weights_from == (2, 1, 2, 3) and plan.hparams_from == (2, 1, 2, 3)
    assert plan.explore == (False,) * 4 and plan.migrations == ((0, 2),)
    # round 2, both: slot 3 (0.4) loses to 2 in sub-population 1, and is offered slot 1 (0.3):
    # below its winner, so it clones 2
    plan = mf_pbt_plan(2, schedule, [0.2, 0.3, 0.5, 0.4])
    assert plan.weights_from == (2, 1, 2, 2) and plan.migrations == ((0, 2),)


def test_ties_rank_the_lower_slot_first():
    plan = mf_pbt_plan(1, MultiFrequency((2, 2), (1, 2)), [0.5, 0.5, 0.5, 0.5])
    # slot 0 wins its sub-population; slot 1 would clone it; outsider 2 ranks below slot 0
    assert plan.weights_from == (0, 0, 2, 3) and plan.migrations == ()


def test_schedule_settings_are_checked():
    assert MultiFrequency.from_config(6, {"intervals": [1, 2, 5]}).sizes == (2, 2, 2)
    assert MultiFrequency.from_config(6, {"intervals": [1, 4], "sizes": [4, 2]}).slots(1) == range(4, 6)
    for size, node, says in [
        (4, {"intervals": [3, 1]}, "strictly rising"),
        (4, {"intervals": [1]}, "at least two"),
        (5, {"intervals": [1, 4]}, "does not split evenly"),
        (6, {"intervals": [1, 4], "sizes": [3, 2]}, "must sum"),
        (4, {"intervals": [1, 4], "sizes": [3, 1]}, "at least 2 members"),
        (4, {"intervals": [1, 4], "sizes": [4]}, "one size per interval"),
    ]:
        with pytest.raises(ValueError, match=says):
            MultiFrequency.from_config(size, node)
    with pytest.raises(ValueError, match="4 fitness values for a population of 8"):
        mf_pbt_plan(1, TWO_BY_FOUR, [0.0] * 4)


def test_a_members_min_lr_ratio_reshapes_its_schedule_from_where_it_is():
    """Cosine over 10 steps, 5 done: the multiplier is m + (1 - m) x 0.5 x (1 + cos(pi/2)) =
    (1 + m) / 2, so lr 1e-3 runs at 0.55e-3 with m = 0.1 and at 0.75e-3 with m = 0.5."""
    w = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([w], lr=1e-3)
    hp = type("HP", (), {"warmup_steps": 0, "min_lr_ratio": 0.1})()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    follow_schedule(sched, hp, 10)
    for _ in range(5):
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.55e-3, rel=1e-12)
    hp.min_lr_ratio = 0.5
    follow_schedule(sched, hp, 10)
    set_base_lrs(opt, sched, [1e-3])
    assert opt.param_groups[0]["lr"] == pytest.approx(0.75e-3, rel=1e-12)
    opt.step()
    sched.step()  # step 6: 0.5 + 0.25 x (1 + cos(0.6 pi))
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 * (0.5 + 0.25 * (1 + math.cos(0.6 * math.pi))))
    assert (
        value_problem("min_lr_ratio", 1.5, {}) is not None and value_problem("min_lr_ratio", 0.0, {}) is None
    )


MF_RUN = [
    *FAST,
    "population.size=4",
    "population.batched=true",
    "population.schedule=mf_pbt",
    "population.mf_pbt.intervals=[1,2]",
    "population.evolve_every=1",
    "population.eval_rows=8",
    "population.no_mutation_prob=0",
    "population.mutate={lr:{low:1e-4,high:1e-2,scale:2},min_lr_ratio:{low:0.05,high:1.0,scale:1.5}}",
    "trainer.val_check_interval=100",
    "eval.before_training=false",
    "eval.at_end=false",
    "checkpoint.every_n_steps=0",
    "trainer.max_steps=8",  # member updates: 2 population steps of 4 members
    "seed=3",
]


def test_mf_pbt_config_errors_are_named(tmp_path):
    for extra, field in [
        (["population.mf_pbt.intervals=[2,1]"], "population.mf_pbt"),
        (["population.mf_pbt.sizes=[3,2]"], "population.mf_pbt"),
        (["population.evolve_every=0"], "population.evolve_every"),
        (["population.mutate={min_lr_ratio:{low:0.5,high:2.0}}"], "population.mutate.min_lr_ratio"),
    ]:
        with pytest.raises(ConfigError) as e:
            validate(compose_config([*MF_RUN, *extra], output_dir=tmp_path / "r"))
        assert e.value.field == field, extra


@pytest.mark.slow
def test_a_population_with_mf_pbt_trains_and_evolves(tmp_path, monkeypatch):
    """Two population steps of 4 members in sub-populations (0, 1) every round and (2, 3) every
    second: round 1 evolves slots 0-1 only, round 2 all four; each evolving slot's lineage row
    follows the plan of the fitness scored then (the plan itself is checked by hand above)."""
    scored: list[tuple[list[float], list[int], list[dict]]] = []
    assign = Generations.assign_fitness

    def spy(self, fitness):
        scored.append((list(fitness), [m.id for m in self.members], [dict(m.hparams) for m in self.members]))
        return assign(self, fitness)

    monkeypatch.setattr(Generations, "assign_fitness", spy)
    out = tmp_path / "run"
    result = run(compose_config(MF_RUN, output_dir=out))
    pop = next(c for c in result.trainer.callbacks if isinstance(c, SideBySidePopulation))
    assert pop.steps == 2 and len(scored) == 2
    lineage = list(csv.DictReader((out / "lineage.csv").open()))
    rows = {step: [r for r in lineage if r["event"] != "init" and int(r["step"]) == step] for step in (4, 8)}
    assert [int(r["slot"]) for r in rows[4]] == [0, 1]
    assert [int(r["slot"]) for r in rows[8]] == [0, 1, 2, 3]
    for round_, step in ((1, 4), (2, 8)):
        fitness, ids, hparams = scored[round_ - 1]
        plan = mf_pbt_plan(round_, pop.multi_frequency, fitness)
        for r in rows[step]:
            slot = int(r["slot"])
            source = plan.weights_from[slot]
            assert r["event"] == ("kept" if plan.kept(slot) else "clone" if plan.explore[slot] else "migrant")
            assert float(r["parent_fitness"]) == fitness[source]
            if r["event"] == "kept":
                assert int(r["id"]) == ids[slot]
            else:
                assert int(r["parent"]) == ids[source] and int(r["id"]) not in ids
            if r["event"] == "clone":  # no_mutation_prob=0: exactly one value moved from the winner's
                moved = [
                    k for k in ("lr", "min_lr_ratio") if float(r[k]) != pytest.approx(hparams[source][k])
                ]
                assert len(moved) == 1, r
    # the members' schedules follow their own min_lr_ratio
    for k, m in enumerate(pop.members):
        assert pop.bank.members[k].hp.min_lr_ratio == pytest.approx(m.hparams["min_lr_ratio"])
