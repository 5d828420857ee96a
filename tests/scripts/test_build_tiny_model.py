"""The arithmetic builder's SFT rows: answers from the env, and with ``noise`` a share of them
carrying exactly one wrong digit (a careless slip), deterministic in the seed."""

from __future__ import annotations

import importlib.util
import json
import random

from rlhf_lightning.envs.arithmetic import make_problem
from tests.conftest import ROOT

spec = importlib.util.spec_from_file_location("build_tiny_model", ROOT / "scripts" / "build_tiny_model.py")
build = importlib.util.module_from_spec(spec)
spec.loader.exec_module(build)


def test_careless_changes_exactly_one_digit_and_keeps_the_sign():
    rng = random.Random(0)
    for answer in (7, 42, -42, 135, -9, 100):
        for _ in range(20):
            slip = build.careless(answer, rng)
            a = str(abs(answer))
            b = str(abs(slip)).zfill(len(a))  # a slipped leading digit may be a 0
            assert len(b) == len(a) and sum(x != y for x, y in zip(a, b)) == 1
            assert slip == 0 or (slip < 0) == (answer < 0)


def test_noisy_rows_keep_the_prompts_and_corrupt_about_the_requested_share(tmp_path):
    clean, noisy = tmp_path / "clean.jsonl", tmp_path / "noisy.jsonl"
    build.write_jsonl(clean, 1, range(2000))
    build.write_jsonl(noisy, 1, range(2000), noise=0.6)
    rows_c = [json.loads(line) for line in clean.read_text().splitlines()]
    rows_n = [json.loads(line) for line in noisy.read_text().splitlines()]
    assert [r["prompt"] for r in rows_c] == [r["prompt"] for r in rows_n]
    assert all(r["completion"] == str(make_problem(1, i, False, 10, 99).answer) for i, r in enumerate(rows_c))
    wrong = sum(c["completion"] != n["completion"] for c, n in zip(rows_c, rows_n))
    assert 0.56 < wrong / 2000 < 0.64  # binomial sd ~0.011
    build.write_jsonl(tmp_path / "again.jsonl", 1, range(2000), noise=0.6)
    assert (tmp_path / "again.jsonl").read_text() == noisy.read_text()
