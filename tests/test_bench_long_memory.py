"""bench/long_episode_memory.py on the tiny Sudoku model: the episode, the estimate against a
measured peak, the table and the slope."""

from __future__ import annotations

import importlib.util
import math
import sys

import pytest

from tests.conftest import ROOT

spec = importlib.util.spec_from_file_location(
    "long_episode_memory", ROOT / "bench" / "long_episode_memory.py"
)
assert spec is not None and spec.loader is not None
bench = importlib.util.module_from_spec(spec)
sys.modules["long_episode_memory"] = bench
spec.loader.exec_module(bench)


def test_sizes_are_prefixes_of_one_hard_game():
    tok = bench.load_tokenizer()
    game = bench.play(tok, 6, think=40)
    b = bench.episode(tok, 1500, think=40)
    ends = bench.turn_lengths(game)
    assert int(game.num_turns[0]) == 6 and len(ends) == 6
    turns = int(b.num_turns[0])
    assert ends[turns - 1] == int(b.attention_mask.sum())  # the nearest turn boundary, as played
    assert all(abs(ends[turns - 1] - 1500) <= abs(e - 1500) for e in ends)
    n = ends[turns - 1]
    assert b.input_ids[0, :n].tolist() == game.input_ids[0, :n].tolist()
    text = tok.decode(b.input_ids[0, :n])
    assert "9x9 grid" in text and text.count("can be") >= turns  # GEM's 9x9 and a reasoning per reply
    assert text.count("\\boxed{") == turns + 2  # one move per reply, two in the instructions


def test_estimate_within_two_percent_of_the_measured_peak():
    arm = ("chunked", False, "float32")
    est = bench.child("estimate", "tiny_sudoku", 2048, arm, 350)
    got = bench.child("measure", "tiny_sudoku", 2048, arm, 350)
    assert est is not None and got is not None
    assert est["tokens"] == got["tokens"] > 1500
    assert got["measured_mb"] > 50  # tiny model, ~2.4k tokens: ~125 MB of activations
    assert est["est_mb"] == pytest.approx(got["measured_mb"], rel=0.02)
    assert est["est_total_mb"] == pytest.approx(est["est_mb"] + est["weights_mb"])


def test_checkpointing_and_chunking_lower_the_estimate():
    base = bench.estimate("tiny_sudoku", 1024, ("naive", False, "float32"), 350)
    ckpt = bench.estimate("tiny_sudoku", 1024, ("naive", True, "float32"), 350)
    chunked = bench.estimate("tiny_sudoku", 1024, ("chunked", False, "float32"), 350)
    assert ckpt["est_mb"] < 0.7 * base["est_mb"] and chunked["est_mb"] < base["est_mb"]
    # naive: the (L, V) logits and their log-softmax are alive at the peak
    width = [shape for _, shape in base["widest_at_peak"]]
    assert any(f"{base['tokens']}, 512)" in s for s in width), width


def test_table_and_slope():
    arm = ["chunked", True, "bfloat16"]
    points = ((4, 4000, 6, 100.0), (8, 8000, 12, 180.0), (16, 16000, 24, 340.0))
    rows = [
        {"size": s * 1024, "tokens": t, "turns": n, "tokens_per_turn": t / n, "arm": arm, "est_mb": mb}
        for s, t, n, mb in points
    ]
    for r in rows:
        r["est_total_mb"] = r["est_mb"] + 1024.0
    rows[0].update(measured_mb=110.0, step_s=12.34)
    assert bench.slope([(r["tokens"], r["est_mb"]) for r in rows]) == pytest.approx(20.0)  # MB per 1k tokens
    assert math.isnan(bench.slope([(4000, 1.0)]))
    lines = bench.table(rows).splitlines()
    assert len(lines) == 2 + 3 and all(line.count("|") == 10 for line in lines)
    assert lines[2] == "| 4k | 4000 | 6 | 667 | chunked, ckpt on, bf16 | 110 | 100 | 1.10 | 12.3 |"
    assert lines[3].split("|")[6:10] == [" — ", " 180 ", " 1.18 ", " — "]
    assert "| chunked, ckpt on, bf16 | 20.0 | — |" in bench.slopes(rows)
