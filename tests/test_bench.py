"""The CPU-runnable parts of the GPU benchmark: the cycle loop, the table and the verdict."""

from __future__ import annotations

import importlib.util
import sys

import pytest

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
