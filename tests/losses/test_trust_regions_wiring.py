"""The new objectives reach training like every registered loss: a ``-m algo.loss=...`` sweep
expands to one job per objective and each job trains a step with that objective's own
parameters; a population mutates a parameter of their params class by its node path."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from rlhf_lightning.config.algo import registered_name, with_hparams
from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.learner.objective import PolicyTerm
from rlhf_lightning.losses import POLICY_LOSSES
from rlhf_lightning.population.evolution import MutationRange, mutate
from rlhf_lightning.run.validation import validate
from tests.conftest import FAST, compose_config, fit_steps

SWEEP = "algo.loss=dppo_tv,dppo_kl,sapo,gmpo,kl_cov"
# A metric only that objective reports (logged as actor/<key>): proof its function ran.
OWN_METRIC = {
    "dppo_tv": "actor/tv_mean",
    "dppo_kl": "actor/kl_mean",
    "sapo": "actor/gate_weight_mean",
    "gmpo": "actor/clipfrac",
    "kl_cov": "actor/cov_mean",
}


def sweep_jobs(*overrides: str) -> list[list[str]]:
    """The jobs Hydra's basic sweeper makes of ``python train.py -m <overrides>``."""
    parsed = OverridesParser.create().parse_overrides(list(overrides))
    (batch,) = BasicSweeper.split_arguments(parsed, None)
    return batch


def test_the_sweep_expands_to_one_job_per_objective_with_its_own_defaults():
    jobs = sweep_jobs(SWEEP, "algo.group_size=4")
    assert jobs == [[f"algo.loss={n}", "algo.group_size=4"] for n in OWN_METRIC]
    for job in jobs[:2]:
        cfg = compose_config([job[0]])
        validate(cfg)
        hp = OmegaConf.to_object(cfg.algo)
        name = registered_name(hp.loss)
        term = PolicyTerm.bind(hp.loss, hp)
        defaults = dataclasses.asdict(POLICY_LOSSES.meta(name)["params"]())
        assert term.name == name and term.kwargs == defaults
        assert cfg.algo.clip_low is None and cfg.algo.clip_high is None  # no ratio clip of their own
    # a node parameter reaches the objective (and a parameter it lacks is refused by name)
    cfg = compose_config(["algo.loss.name=sapo", "+algo.loss.tau_neg=2.0"])
    validate(cfg)
    hp = OmegaConf.to_object(cfg.algo)
    assert PolicyTerm.bind(hp.loss, hp).kwargs == {"tau_pos": 1.0, "tau_neg": 2.0}
    with pytest.raises(ConfigError, match=r"algo\.loss\.tau_neg=2\.0.*DPPOTVParams"):
        validate(compose_config(["algo.loss.name=dppo_tv", "+algo.loss.tau_neg=2.0"]))


@pytest.mark.parametrize("job", [j[0] for j in sweep_jobs(SWEEP)])
def test_each_sweep_job_trains_a_step_with_its_objective(tmp_path, monkeypatch, job):
    cfg = compose_config(
        [*FAST, job, "trainer.max_steps=1", "samples.every_n_steps=0", "algo.skip_zero_advantage=false"],
        output_dir=tmp_path / "run",
    )
    validate(cfg)
    name = job.split("=", 1)[1]
    calls = []
    original = POLICY_LOSSES.get(name)

    def spy(*args, **kwargs):
        calls.append(sorted(kwargs))
        return original(*args, **kwargs)

    monkeypatch.setitem(POLICY_LOSSES._entries, name, spy)  # looked up by name at every micro-step
    _, trainer = fit_steps(cfg, tmp_path, steps=1)
    metrics = trainer.callback_metrics
    assert trainer.global_step == 1
    params = sorted(f.name for f in dataclasses.fields(POLICY_LOSSES.meta(name)["params"]))
    assert calls and all(c == params for c in calls), calls
    assert OWN_METRIC[name] in metrics, sorted(metrics)
    assert 0.0 < float(metrics["actor/ratio_mean"]) < 10.0


def test_a_population_mutates_an_objective_parameter_by_its_node_path():
    cfg = compose_config(
        [
            *FAST,
            "algo.loss=dppo_tv",
            "population.size=2",
            "+population.mutate={loss.delta_high: {low: 0.05, high: 0.8, scale: 2.0}}",
        ]
    )
    validate(cfg)  # the range is a parameter of DPPOTVParams, every value in it valid
    hp = OmegaConf.to_object(cfg.algo)
    space = {"loss.delta_high": MutationRange(0.05, 0.8, 2.0)}
    seen = set()
    for seed in range(8):
        out, what = mutate({"loss.delta_high": 0.2}, space, random.Random(seed), no_mutation_prob=0.0)
        assert what.startswith("loss.delta_high ")
        member = with_hparams(hp, out)
        term = PolicyTerm.bind(member.loss, member)
        assert term.kwargs == {"delta_low": 0.2, "delta_high": out["loss.delta_high"]}
        seen.add(out["loss.delta_high"])
    assert seen == {0.1, 0.4}  # x2 or /2 from 0.2
    assert PolicyTerm.bind(hp.loss, hp).kwargs["delta_high"] == 0.2  # the run's config is untouched


@pytest.mark.parametrize(
    ("loss", "mutated", "named"),
    [
        ("sapo", "loss.tau", "tau_neg, tau_pos"),
        ("gmpo", "clip_high", "does not use clip_high"),
    ],
)
def test_a_population_refuses_a_parameter_the_objective_lacks(loss, mutated, named):
    cfg = compose_config(
        [
            *FAST,
            f"algo.loss={loss}",
            "population.size=2",
            f"+population.mutate={{{mutated}: {{low: 0.1, high: 2.0}}}}",
        ]
    )
    with pytest.raises(ConfigError, match=named):
        validate(cfg)


def test_the_configuration_reference_lists_every_registered_objective_and_estimator():
    from rlhf_lightning.losses import ADVANTAGE_ESTIMATORS
    from tests.conftest import ROOT

    page = (ROOT / "docs" / "reference" / "config.md").read_text()
    for name in POLICY_LOSSES.names():
        params = POLICY_LOSSES.meta(name)["params"]
        assert f"- `{name}` ({params.__name__}" in page, name
    for name in ("dppo_tv", "dppo_kl", "sapo", "gmpo", "kl_cov"):
        assert "arXiv" in page.split(f"- `{name}` (", 1)[1].split("\n", 1)[0], name
    assert "- `gdpo` (" in page and ADVANTAGE_ESTIMATORS.meta("gdpo")["kind"] == "outcome"
