"""A bad key fails in Hydra's composition, and a bad value of a common field in the early checks,
before torch, Lightning or transformers are imported (``train.py`` imports the run only after
``rlhf_lightning.config.early.early_checks``; the config schemas import none of them). How long
it takes is measured by ``bench/startup.py``, not here."""

from __future__ import annotations

import subprocess
import sys
import tempfile

import pytest

from tests.conftest import ROOT

HEAVY = ("torch", "lightning", "transformers", "peft")


def imported_modules(stderr: str) -> set[str]:
    """Top-level module names from ``python -X importtime``'s report."""
    names = set()
    for line in stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip().split(".")[0])
    return names


def failed_run(*overrides: str) -> tuple[str, set[str]]:
    """``train.py`` with ``overrides``, which must fail: its stderr and the modules it imported."""
    with tempfile.TemporaryDirectory() as out:  # a refused run's directory is not left in outputs/
        proc = subprocess.run(
            [sys.executable, "-X", "importtime", "train.py", *overrides, f"output_dir={out}/run"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert proc.returncode != 0
    return proc.stderr, imported_modules(proc.stderr)


def test_a_typo_in_a_key_fails_before_the_heavy_imports():
    stderr, modules = failed_run("algo.lrr=1")
    assert "algo.lrr" in stderr and "Key 'lrr' not in 'GRPOConfig'" in stderr
    assert {"hydra", "omegaconf", "rlhf_lightning"} <= modules
    assert not modules & set(HEAVY), sorted(modules & set(HEAVY))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("algo.lr=-1", "error: invalid config: algo.lr=-1.0: a learning rate > 0"),
        ("rollout.top_p=2", "error: invalid config: rollout.top_p=2.0: in (0, 1]"),
        ("model.dtype=fp8", "error: invalid config: model.dtype='fp8'"),
        ("trainer.max_steps=0", "error: invalid config: trainer.max_steps=0"),
        (
            "algo.loss=foo",
            "error: invalid config: algo.loss='foo': one of cispo, dppo_kl, dppo_tv, gmpo, gspo, kl_cov, ppo_clip, reinforce, sapo",
        ),
        ("algo.advantage=gae", "error: invalid config: algo.advantage='gae'"),
        ("algo=ppo algo.kl_mode=bar", "Invalid value 'bar', expected one of [loss, reward, advantage]"),
    ],
)
def test_a_bad_common_value_fails_before_the_heavy_imports(override, message):
    stderr, modules = failed_run(*override.split())
    assert message in stderr
    assert not modules & set(HEAVY), sorted(modules & set(HEAVY))


def test_the_early_name_lists_are_the_registries_names():
    """The names field_checks accepts before torch are exactly the registries' built-in ones
    (read in a fresh interpreter: a test may have registered a loss of its own in this one)."""
    code = (
        "from rlhf_lightning.config import algo as ac\n"
        "from rlhf_lightning.losses import ADVANTAGE_ESTIMATORS as A, AGGREGATION_MODES, KL_ESTIMATORS, POLICY_LOSSES\n"
        "outcome = [n for n in A.names() if A.meta(n).get('kind') == 'outcome']\n"
        "assert list(ac.BUILTIN_POLICY_LOSSES) == POLICY_LOSSES.names(), POLICY_LOSSES.names()\n"
        "assert list(ac.BUILTIN_OUTCOME_ADVANTAGES) == outcome, outcome\n"
        "assert ac.BUILTIN_AGGREGATION_MODES == tuple(AGGREGATION_MODES), AGGREGATION_MODES\n"
        "assert ac.BUILTIN_KL_ESTIMATORS == tuple(KL_ESTIMATORS), KL_ESTIMATORS\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
