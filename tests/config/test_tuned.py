"""Tuned settings are keyed on the model and the family (``conf/tuned/<model>/<family>.yaml``),
not on the option's name: a user's option built on ``algo/grpo.yaml`` gets GRPO's tuned values,
and the run says which file applied."""

from __future__ import annotations

import textwrap

import pytest
from omegaconf import OmegaConf

from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.run.fit import tuned_line
from rlhf_lightning.run.validation import validate
from tests.conftest import CONF, compose_config

SOFT = textwrap.dedent(
    """\
    # A user's option, outside the package: GRPO with another loss.
    defaults:
      - grpo
      - _self_

    name: soft_grpo
    loss: {name: cispo}
    """
)


def settings(cfg) -> tuple:
    return (cfg.algo.lr, cfg.algo.prompts_per_step, cfg.algo.group_size, cfg.trainer.max_steps)


@pytest.fixture
def user_conf(tmp_path):
    (tmp_path / "algo").mkdir()
    (tmp_path / "algo" / "soft_grpo.yaml").write_text(SOFT)
    return f"hydra.searchpath=[file://{tmp_path}]"


def test_a_users_option_gets_the_tuned_settings_of_its_family(user_conf):
    grpo = compose_config(["algo=grpo"])
    soft = compose_config([user_conf, "algo=soft_grpo"])
    # the tiny model's GRPO-family values (conf/tuned/tiny/grpo.yaml), not the option's own defaults
    assert settings(grpo) == (1.0e-3, 16, 8, 900)
    assert settings(soft) == settings(grpo)
    assert (soft.family, soft.tuned, soft.algo.loss.name) == ("grpo", "tiny/grpo", "cispo")
    validate(soft)


def test_every_option_of_a_family_shares_its_tuned_file():
    for algo in ("grpo", "cispo", "dapo", "dr_grpo", "gspo", "reinforce", "reinforce_pp", "rloo"):
        cfg = compose_config([f"algo={algo}"])
        assert (cfg.family, cfg.tuned) == ("grpo", "tiny/grpo"), algo
    ppo = compose_config(["algo=ppo"])
    assert (ppo.family, ppo.tuned, ppo.algo.lr, ppo.algo.lr_critic) == ("ppo", "tiny/ppo", 1e-3, 2e-3)
    for algo in ("dpo", "sft"):
        cfg = compose_config([f"algo={algo}"])
        assert (cfg.family, cfg.tuned) == (algo, f"tiny/{algo}")
    assert not list((CONF / "tuned" / "tiny").glob("cispo.yaml"))  # no per-option aliases


def test_a_model_without_tuned_settings_keeps_the_options_values():
    cfg = compose_config(["algo=grpo", "model=qwen0.5b"])
    assert cfg.tuned is None and cfg.algo.lr == 1.0e-5 and cfg.algo.prompts_per_step == 32
    assert "none for this model and family grpo" in tuned_line(cfg)


def test_the_log_names_the_tuned_file():
    cfg = compose_config(["algo=dapo"])
    assert tuned_line(cfg).startswith("tuned settings: conf/tuned/tiny/grpo.yaml (family grpo)")


def test_a_family_that_disagrees_with_the_module_is_named(tmp_path):
    (tmp_path / "algo").mkdir()
    (tmp_path / "algo" / "odd.yaml").write_text(
        "defaults:\n  - /schema/algo/ppo@_here_\n  - override /family@_global_.family: grpo\n  - _self_\n"
        "name: odd\nmodule: ppo\n"
    )
    cfg = compose_config([f"hydra.searchpath=[file://{tmp_path}]", "algo=odd"])
    with pytest.raises(ConfigError, match=r"family='grpo'.*override /family@_global_.family: ppo"):
        validate(cfg)


def test_a_family_from_outside_gets_no_tuned_settings(tmp_path):
    """An option with no family (a family registered outside the package) keeps its own values."""
    (tmp_path / "algo").mkdir()
    (tmp_path / "algo" / "mine.yaml").write_text(
        "defaults:\n  - /schema/algo/grpo@_here_\n  - _self_\nname: mine\nmodule: grpo\nlr: 2.0e-3\n"
    )
    cfg = compose_config([f"hydra.searchpath=[file://{tmp_path}]", "algo=mine"])
    assert (cfg.family, cfg.tuned, cfg.algo.lr) == ("none", None, 2.0e-3)
    assert OmegaConf.select(cfg, "trainer.max_steps") != 900
