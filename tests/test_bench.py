"""The CPU-runnable parts of the GPU benchmark: the cycle loop, the table and the verdict."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from tests.conftest import ROOT

spec = importlib.util.spec_from_file_location("gpu_sleep_wake", ROOT / "bench" / "gpu_sleep_wake.py")
bench = importlib.util.module_from_spec(spec)
sys.modules["gpu_sleep_wake"] = bench  # dataclasses look their module up there
spec.loader.exec_module(bench)


class FakeEngine:
    """Holds `weights + kv` bytes awake; sleep keeps `kept` of them; leaks `leak` bytes per cycle."""

    def __init__(self, weights=1000 << 20, kv=3000 << 20, kept=0, leak=0):
        self.weights, self.kv, self.kept, self.leak = weights, kv, kept, leak
        self.used, self.calls, self.awake, self.leaked = 0, [], False, 0

    def wake(self):
        self.calls.append("wake")
        if not self.awake:
            self.used = self.weights + self.kv + self.leaked
            self.awake = True

    def sleep(self):
        self.calls.append("sleep")
        self.leaked += self.leak
        self.used = self.kept + self.leaked
        self.awake = False

    def sync_weights(self, policy):
        self.calls.append("sync")

    def generate(self, prompts, params):
        self.calls.append("generate")
        return []


def test_cycles_measure_freed_memory_and_growth():
    engine = FakeEngine()
    cycles = bench.run_cycles(engine, None, 3, lambda: engine.used + 500, 500, [1, 2])
    assert engine.calls == ["wake", "sync", "generate", "sleep"] * 3
    assert [c.freed_frac for c in cycles] == [1.0, 1.0, 1.0]
    text = bench.table(cycles)
    assert text.count("\n") == 4 and "| 0 | 4000 | 0 | 100.0% | +0 |" in text
    assert "meets" in bench.verdict(cycles, level=1) and "none" in bench.verdict(cycles, level=1)


def test_verdict_flags_leaks_and_incomplete_sleep():
    engine = FakeEngine(kept=1000 << 20, leak=100 << 20)
    cycles = bench.run_cycles(engine, None, 4, lambda: engine.used, 0, [1])
    assert cycles[0].freed_frac == pytest.approx(1 - 1100 / 4000)  # kept 1000 MiB + 100 leaked
    v = bench.verdict(cycles, level=1)
    assert "misses" in v and "GROWS" in v and "+300 MiB" in v


def test_arguments():
    a = bench.parse_args(["--model", "/m", "--cycles", "4", "--level", "2", "--full"])
    assert (a.model, a.cycles, a.level, a.full) == ("/m", 4, 2, True)
    with pytest.raises(SystemExit):
        bench.parse_args(["--model", "/m", "--level", "3"])


@pytest.mark.slow
def test_population_benchmark_runs_both_arms_end_to_end(tmp_path):
    """bench/population.py at a toy budget: both arms run in their own processes and report
    steps to a target no run can reach (so each arm spends its whole budget)."""
    import json
    import os
    import subprocess

    cmd = [
        sys.executable, str(ROOT / "bench" / "population.py"), "--seeds", "0", "--members", "2",
        "--trials", "2", "--trial-steps", "4", "--evolve-every", "2", "--eval-rows", "10",
        "--target", "1.01", "--work", str(tmp_path / "w"), "--json", str(tmp_path / "r.json"),
        "--plot", str(tmp_path / "p.png"),
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "| population | 0 | not reached in 8 |" in proc.stdout
    assert "| optuna | 0 | not reached in 8 |" in proc.stdout  # every trial's steps, pruned or not
    assert "fewer member updates than the search on 0 of 1 seeds" in proc.stdout
    results = json.loads((tmp_path / "r.json").read_text())
    population = next(r for r in results if r["arm"] == "population")
    # side by side: a scoring every 2 population steps = 4 member updates, each timed
    assert [c[0] for c in population["curve"]] == [4, 8]
    assert len(population["times"]) == 2 and 0 < population["times"][0] < population["times"][1]
    starts = [r for r in population["lineage"] if r["event"] == "init"]
    assert len(starts) == 2 and starts[0]["lr"] != starts[1]["lr"]  # drawn from the prior
    search = next(r for r in results if r["arm"] == "optuna")
    assert sum(t["ran"] for t in search["trials"]) == 8 == search["budget"] == population["budget"]
    assert (tmp_path / "p.png").stat().st_size > 0


def test_population_benchmark_counts_equal_compute():
    """Both arms spend trials x trial_steps member updates; steps to target count every earlier
    trial as far as it ran (pruned ones too) and the population's updates of all members."""
    import argparse

    spec = importlib.util.spec_from_file_location("bench_population", ROOT / "bench" / "population.py")
    pop = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pop)
    args = argparse.Namespace(trials=4, trial_steps=400, members=4, evolve_every=50)
    assert pop.budget(args) == (1600, 400)  # 1600 updates: 4 members x 400 population steps
    with pytest.raises(SystemExit, match="whole --evolve-every"):
        pop.budget(argparse.Namespace(trials=3, trial_steps=100, members=4, evolve_every=50))
    # the population: its scorings at 200, 400, ... member updates (every 50 population steps of 4)
    assert pop.population_steps_to_target([(200, 0.3), (400, 0.46), (600, 0.5)], 0.45) == 400
    assert pop.population_steps_to_target([(200, 0.3)], 0.45) is None
    # 90 of 200 right, logged as float32, reaches 0.45
    assert pop.population_steps_to_target([(200, float(torch.tensor(90 / 200)))], 0.45) == 200
    assert pop.population_steps_to_target([(200, 0.4499)], 0.45) is None
    trials = [
        {"curve": [(50, 0.1), (100, 0.1)], "ran": 100},  # pruned at 100
        {"curve": [(50, 0.2), (100, 0.3), (150, 0.3), (200, 0.3)], "ran": 200},
        {"curve": [(50, 0.3), (100, 0.5)], "ran": 100},  # reaches it at its step 100
    ]
    assert pop.search_steps_to_target(trials, 0.45) == 100 + 200 + 100
    assert pop.search_steps_to_target(trials[:2], 0.45) is None
    results = [
        {"arm": "population", "seed": 0, "steps_to_target": 400},
        {"arm": "optuna", "seed": 0, "steps_to_target": 400},  # a tie is no win
        {"arm": "population", "seed": 1, "steps_to_target": 800},
        {"arm": "optuna", "seed": 1, "steps_to_target": None},
        {"arm": "population", "seed": 2, "steps_to_target": None},
        {"arm": "optuna", "seed": 2, "steps_to_target": 900},
    ]
    assert pop.evolution_wins(results, [0, 1, 2]) == 1
