"""One rule for registered functions: ``algo.loss: {name, <params>}`` and ``algo.advantage:
{name, <params>}``. A loss or estimator from outside the package takes its parameters in its
node, so they can be swept (``-m algo.loss.<param>=a,b``) and mutated by a population like the
built-in ones; the flat spellings (``algo.loss=cispo``, ``algo.clip_high``,
``algo.loss_kwargs``, ``algo.advantage_scale``) stay as aliases."""

from __future__ import annotations

import csv
import os
import sys
import textwrap
from dataclasses import dataclass

import pytest
from omegaconf import OmegaConf

from rlhf_lightning.algorithms.checks import resolve_algo
from rlhf_lightning.config.algo import GRPOConfig, registered_name, with_hparams
from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.learner.objective import PolicyTerm
from rlhf_lightning.run.validation import validate
from tests.cli_zygote import run_cli
from tests.conftest import FAST, ROOT, compose_config
from tests.conftest import USER_LOSS_MODULE as MODULE

OPTION = textwrap.dedent(
    f"""\
    # A user's option: GRPO with an outside loss whose parameter lives in the loss node.
    defaults:
      - grpo
      - _self_

    name: scaled
    loss:
      name: {MODULE}.scaled_pg
      scale: 1.0
    """
)


def test_the_default_options_compose_nodes():
    cfg = compose_config(["algo=cispo"])
    assert OmegaConf.to_container(cfg.algo.loss) == {"name": "cispo"}
    assert OmegaConf.to_container(cfg.algo.advantage) == {"name": "grpo"}


def test_flat_spellings_are_aliases_of_the_node():
    """``algo.loss=gspo`` (a name), ``algo.loss.clip_high`` (a field of the built-in params
    class, kept in the flat field) and ``algo.advantage.scale`` (``advantage_scale``) all land
    where the built-in code reads them."""
    cfg = compose_config(["algo.loss=gspo", "algo.advantage.name=grpo", "+algo.advantage.scale=batch"])
    resolve_algo(cfg.algo)
    assert OmegaConf.to_container(cfg.algo.loss) == {"name": "gspo"}
    assert cfg.algo.clip_high == pytest.approx(4e-4)  # gspo's own bound: the node's name decided it
    assert cfg.algo.advantage_scale == "batch" and OmegaConf.to_container(cfg.algo.advantage) == {
        "name": "grpo"
    }
    cfg = compose_config(["+algo.loss.clip_high=0.31"])
    resolve_algo(cfg.algo)
    assert cfg.algo.clip_high == pytest.approx(0.31) and "clip_high" not in cfg.algo.loss
    resolve_algo(cfg.algo)  # idempotent
    assert cfg.algo.clip_high == pytest.approx(0.31)


def test_an_outside_loss_binds_its_node_params(user_loss_module):
    cfg = compose_config([f"algo.loss.name={MODULE}.scaled_pg", "+algo.loss.scale=0.25"])
    validate(cfg)
    hp = OmegaConf.to_object(cfg.algo)
    assert registered_name(hp.loss) == f"{MODULE}.scaled_pg"
    term = PolicyTerm.bind(hp.loss, hp)
    assert term.kwargs == {"scale": 0.25}
    # the old spelling still works
    cfg = compose_config([f"algo.loss={MODULE}.scaled_pg", "+algo.loss_kwargs.scale=0.5"])
    validate(cfg)
    hp = OmegaConf.to_object(cfg.algo)
    assert PolicyTerm.bind(hp.loss, hp).kwargs == {"scale": 0.5}


def test_an_unknown_node_param_is_named(user_loss_module):
    with pytest.raises(ConfigError) as err:
        validate(compose_config([f"algo.loss.name={MODULE}.scaled_pg", "+algo.loss.alpha=2"]))
    assert str(err.value).startswith("invalid config: algo.loss.alpha=2")
    assert "ScaledParams" in str(err.value) and "scale" in str(err.value)
    with pytest.raises(ConfigError, match=r"algo\.advantage\.tau=2"):
        validate(compose_config(["+algo.advantage.tau=2"]))


def test_with_hparams_sets_fields_and_node_params():
    @dataclass
    class Toy:
        lr: float = 1.0
        loss: object = None

    hp = Toy(loss={"name": "x", "scale": 1.0})
    out = with_hparams(hp, {"lr": 0.5, "loss.scale": 3.0, "temperature": 0.7})
    assert out.lr == 0.5 and out.loss == {"name": "x", "scale": 3.0}
    assert hp.loss == {"name": "x", "scale": 1.0}  # a copy: the run's config is untouched
    assert with_hparams(GRPOConfig(), {"clip_high": 0.3}).clip_high == 0.3


@pytest.mark.slow
def test_an_outside_loss_param_is_swept_from_the_command_line(user_loss_module, tmp_path):
    conf = tmp_path / "conf"
    (conf / "algo").mkdir(parents=True)
    (conf / "algo" / "scaled.yaml").write_text(OPTION)
    sweep = tmp_path / "sweep"
    cmd = [
        sys.executable,
        str(ROOT / "train.py"),
        "-m",
        f"hydra.searchpath=[file://{conf}]",
        "algo=scaled",
        "algo.loss.scale=0.5,2.0",
        f"hydra.sweep.dir={sweep}",
        "trainer.max_steps=1",
        "trainer.val_check_interval=1",
        "trainer.enable_progress_bar=false",
        "algo.prompts_per_step=4",
        "algo.group_size=4",
        "env.kwargs.eval_size=8",
        "eval.batch_size=8",
        "num_threads=1",
    ]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{user_loss_module}"}
    proc = run_cli(cmd, cwd=ROOT, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = {}
    for metrics in sorted(sweep.glob("*/metrics.csv")):
        with metrics.open() as f:
            rows = [r for r in csv.DictReader(f) if r.get("actor/scale")]
        saved = OmegaConf.load(metrics.parent / "config.yaml")
        seen[float(saved.algo.loss.scale)] = {float(r["actor/scale"]) for r in rows}
    assert seen == {0.5: {0.5}, 2.0: {2.0}}


@pytest.mark.slow
@pytest.mark.parametrize("batched", [True, False], ids=["side_by_side", "round_robin"])
def test_a_population_mutates_an_outside_loss_param(user_loss_module, tmp_path, batched):
    from tests.conftest import fit_steps

    cfg = compose_config(
        [
            *FAST,
            f"algo.loss.name={MODULE}.scaled_pg",
            "+algo.loss.scale=1.0",
            "algo.skip_zero_advantage=false",  # every member's update calls the loss
            "population.size=2",
            f"population.batched={str(batched).lower()}",
            "population.init=config",
            "population.resample_prob=0",
            "population.mutate_initial=true",
            "population.no_mutation_prob=0.0",
            "+population.mutate={loss.scale: {low: 0.1, high: 10.0, scale: 4.0}}",
            "trainer.max_steps=2",
            "samples.every_n_steps=0",
        ],
        output_dir=tmp_path / "run",
    )
    validate(cfg)
    from rlhf_lightning.run.factories import population_callback

    pop = population_callback(cfg, tmp_path / "run")
    fit_steps(cfg, tmp_path, steps=2, callbacks=[pop])
    seen = sys.modules[MODULE].SEEN
    scales = [m.hparams["loss.scale"] for m in pop.members]
    assert scales[0] == 1.0 and scales[1] in (0.25, 4.0)
    assert set(seen) == {1.0, scales[1]}  # each member's update used its own value
