"""bench/population.py: the equal-compute accounting, the final best of each arm and the
updates to target, by hand; and the three arms end to end at a toy budget."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT

spec = importlib.util.spec_from_file_location("bench_population", ROOT / "bench" / "population.py")
pop = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pop)


def trial(ran: int, curve: list[tuple[int, float]], pruned: bool = False) -> dict:
    return {"ran": ran, "curve": curve, "pruned": pruned}


def test_the_budget_splits_into_whole_rounds():
    args = argparse.Namespace(trials=4, trial_steps=400, members=4, evolve_every=50)
    assert pop.budget(args) == (1600, 400)  # 1600 updates: 4 members x 400 population steps
    with pytest.raises(SystemExit, match="whole --evolve-every"):
        pop.budget(argparse.Namespace(trials=3, trial_steps=100, members=4, evolve_every=50))


def test_the_search_spends_the_budget_trial_by_trial_pruned_ones_as_far_as_they_ran():
    """1600 updates, trials of 400: complete 400, pruned at 100, pruned at 50, complete 400 twice,
    then the 250 left (1600 - 400 - 100 - 50 - 400 - 400), then nothing."""
    ran: list[int] = []
    lengths = []
    for actual in (400, 100, 50, 400, 400, 250):
        lengths.append(pop.next_trial_steps(1600, 400, ran))
        ran.append(actual)
    assert lengths == [400, 400, 400, 400, 400, 250]
    assert pop.next_trial_steps(1600, 400, ran) == 0
    search = {
        "arm": "optuna",
        "budget": 1600,
        "trials": [
            trial(400, [(400, 0.41)]),
            trial(100, [(50, 0.9), (100, 0.2)], pruned=True),
            trial(50, [(50, 0.1)], pruned=True),
            trial(400, [(400, 0.47)]),
            trial(400, [(400, 0.47)]),
            trial(250, [(250, 0.30)]),
        ],
    }
    assert pop.accounting(search) == {
        "budget": 1600,
        "spent": 1600,
        "trials": 6,
        "complete": 4,
        "pruned": 2,
        "pruned_updates": 150,
    }
    # the search hands over its best complete trial's last evaluation (ties: the earlier trial);
    # a pruned trial's evaluation, however high, is no model it kept
    assert pop.final_best_search(search["trials"]) == (0.47, 3)
    assert pop.final_best_search([trial(100, [(50, 0.9)], pruned=True)]) == (None, None)
    assert pop.final_best_search([trial(30, [])]) == (None, None)  # too short to be evaluated


def test_a_population_spends_members_times_population_steps_and_ends_at_its_last_scoring():
    population = {"arm": "population", "budget": 1600, "population_steps_run": 400, "members": 4}
    assert pop.accounting(population)["spent"] == 1600
    assert pop.accounting({**population, "population_steps_run": 350})["spent"] == 1400
    curve = [(200, 0.3), (1400, 0.55), (1600, 0.52)]
    assert pop.final_best_population(curve, 1600) == 0.52  # the end's, not the best ever seen
    assert pop.final_best_population(curve[:2], 1600) is None


def test_updates_to_target_count_every_earlier_trial_and_all_members():
    # the population: its scorings at 200, 400, ... member updates (every 50 population steps of 4)
    assert pop.population_steps_to_target([(200, 0.3), (400, 0.46), (600, 0.5)], 0.45) == 400
    assert pop.population_steps_to_target([(200, 0.3)], 0.45) is None
    # 90 of 200 right, logged as float32, reaches 0.45
    assert pop.population_steps_to_target([(200, float(torch.tensor(90 / 200)))], 0.45) == 200
    assert pop.population_steps_to_target([(200, 0.4499)], 0.45) is None
    trials = [
        trial(100, [(50, 0.1), (100, 0.1)], pruned=True),
        trial(200, [(50, 0.2), (100, 0.3), (150, 0.3), (200, 0.3)]),
        trial(100, [(50, 0.3), (100, 0.5)]),  # reaches it at its step 100
    ]
    assert pop.search_steps_to_target(trials, 0.45) == 100 + 200 + 100
    assert pop.search_steps_to_target(trials[:2], 0.45) is None


def test_wins_per_seed():
    results = [
        {"arm": "population", "seed": 0, "steps_to_target": 400, "final_best": 0.50},
        {"arm": "optuna", "seed": 0, "steps_to_target": 400, "final_best": 0.50},  # a tie
        {"arm": "population", "seed": 1, "steps_to_target": 800, "final_best": 0.40},
        {"arm": "optuna", "seed": 1, "steps_to_target": None, "final_best": 0.45},
        {"arm": "population", "seed": 2, "steps_to_target": None, "final_best": 0.30},
        {"arm": "optuna", "seed": 2, "steps_to_target": 900, "final_best": None},  # no complete trial
    ]
    assert pop.evolution_wins(results, [0, 1, 2]) == 1  # seed 1; a tie in updates is no win
    assert pop.final_wins(results, [0, 1, 2]) == 2  # seeds 0 (at least the search's) and 2
    assert pop.final_wins(results, [0, 1, 2], arm="mf_pbt") == 0


@pytest.mark.slow
def test_population_benchmark_runs_every_arm_end_to_end(tmp_path):
    """The three arms at a toy budget (8 member updates: 4 members x 2 population steps; trials of
    4 steps), each in its own process, each spending its whole budget."""
    cmd = [
        sys.executable, str(ROOT / "bench" / "population.py"), "--seeds", "0", "--members", "4",
        "--trials", "2", "--trial-steps", "4", "--evolve-every", "1", "--mf-intervals", "1", "2",
        "--eval-rows", "10", "--target", "1.01", "--work", str(tmp_path / "w"),
        "--json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "p.png"),
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    results = {r["arm"]: r for r in json.loads((tmp_path / "r.json").read_text())}
    assert set(results) == {"population", "mf_pbt", "optuna"}
    for arm, r in results.items():
        assert pop.accounting(r)["spent"] == 8 == r["budget"], arm
        assert r["steps_to_target"] is None  # 1.01 is out of reach
        assert f"| {arm} | 0 | " in proc.stdout
    for arm in ("population", "mf_pbt"):
        curve = results[arm]["curve"]
        assert [c[0] for c in curve] == [4, 8]  # a scoring every population step = 4 member updates
        assert results[arm]["final_best"] == curve[-1][1]
        starts = [x for x in results[arm]["lineage"] if x["event"] == "init"]
        assert len({x["lr"] for x in starts}) == 4  # drawn from the prior
        assert {x["min_lr_ratio"] for x in starts} != {""}
        assert f"{arm}'s final best at least the search's on" in proc.stdout
    # mf_pbt: round 1 evolves sub-population 0 (slots 0, 1) only, round 2 both
    evolved = [(int(x["step"]), int(x["slot"])) for x in results["mf_pbt"]["lineage"] if x["event"] != "init"]
    assert evolved == [(4, 0), (4, 1), (8, 0), (8, 1), (8, 2), (8, 3)]
    search = results["optuna"]
    assert search["final_best"] == pop.final_best_search(search["trials"])[0]
    assert all("min_lr_ratio" in t for t in search["trials"])
    assert (tmp_path / "p.png").stat().st_size > 0
