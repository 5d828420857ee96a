"""Algorithm families are registered records: a new one needs its module and its YAML only."""

from __future__ import annotations

import csv
import os
import sys
from pathlib import Path

import pytest

from rlhf_lightning.algorithms import ALGORITHMS, AlgorithmSpec, get_algorithm, register_algorithm
from rlhf_lightning.algorithms.grpo import GRPOModule
from rlhf_lightning.config import GRPOConfig
from tests.cli_zygote import run_cli
from tests.conftest import ROOT

TOY_YAML = """\
# A family defined outside the package: the module registers it when imported.
module: tests.algorithms.toy_family
name: toy
lr: 2.0e-3
group_size: 4
prompts_per_step: 4
"""


def test_builtin_families_and_their_facts():
    assert {"grpo", "ppo", "sft", "dpo"} <= set(ALGORITHMS)
    assert get_algorithm("ppo").needs_critic and not get_algorithm("grpo").needs_critic
    assert get_algorithm("dpo").data == "offline" and get_algorithm("dpo").offline_kind == "preference"
    assert get_algorithm("grpo").needs_reference(GRPOConfig(beta=0.1))
    assert not get_algorithm("grpo").needs_reference(GRPOConfig(beta=0.0))
    with pytest.raises(ValueError, match="already registered"):
        register_algorithm(AlgorithmSpec("grpo", GRPOModule, GRPOConfig))
    with pytest.raises(KeyError, match=r"valid: .*grpo"):
        get_algorithm("grpoo")


@pytest.mark.slow
def test_a_family_from_a_test_module_trains_through_the_cli(tmp_path):
    conf = tmp_path / "conf"
    (conf / "algo").mkdir(parents=True)
    (conf / "algo" / "toy.yaml").write_text(TOY_YAML)
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        str(ROOT / "train.py"),
        f"hydra.searchpath=[file://{conf}]",
        "algo=toy",
        f"output_dir={out}",
        "trainer.max_steps=2",
        "trainer.val_check_interval=2",
        "trainer.enable_progress_bar=false",
        "env.kwargs.eval_size=20",
        "eval.batch_size=20",
        "num_threads=1",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = run_cli(cmd, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with Path(out, "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    norms = [float(r["actor/grad_norm"]) for r in rows if r.get("actor/grad_norm")]
    assert len(norms) == 2 and all(n > 0 for n in norms)
    assert any(r.get("eval/accuracy_greedy") for r in rows)
    # a typo in the family's YAML is named at start-up, like any other field
    bad = [c for c in cmd if not c.startswith("output_dir")] + [
        f"output_dir={tmp_path / 'bad'}",
        "+algo.lrr=1",
    ]
    proc = run_cli(bad, cwd=ROOT, env=env, timeout=300)
    assert proc.returncode != 0 and "lrr" in proc.stderr


def test_each_family_module_types_hp_as_its_schema():
    """``hp`` is the family's schema on every module (mypy checks every use against it)."""
    import typing

    from rlhf_lightning.algorithms.dpo import DPOModule
    from rlhf_lightning.algorithms.ppo import PPOModule
    from rlhf_lightning.algorithms.sft import SFTModule
    from rlhf_lightning.config import DPOConfig, PPOConfig, SFTConfig

    for module, schema in (
        (GRPOModule, GRPOConfig),
        (PPOModule, PPOConfig),
        (SFTModule, SFTConfig),
        (DPOModule, DPOConfig),
    ):
        assert typing.get_type_hints(module)["hp"] is schema, module
