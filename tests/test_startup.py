"""A bad key fails in Hydra's composition, before torch, Lightning or transformers are imported
(``train.py`` imports the run only inside ``main``; the config schemas import none of them).
How long it takes is measured by ``bench/startup.py``, not here."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT

HEAVY = ("torch", "lightning", "transformers", "peft")


def imported_modules(stderr: str) -> set[str]:
    """Top-level module names from ``python -X importtime``'s report."""
    names = set()
    for line in stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip().split(".")[0])
    return names


def test_a_typo_in_a_key_fails_before_the_heavy_imports():
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "train.py", "algo.lrr=1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "algo.lrr" in proc.stderr and "Key 'lrr' not in 'GRPOConfig'" in proc.stderr
    modules = imported_modules(proc.stderr)
    assert {"hydra", "omegaconf", "rlhf_lightning"} <= modules
    assert not modules & set(HEAVY), sorted(modules & set(HEAVY))
