"""Clip bounds follow the chosen loss: ``algo.clip_low`` / ``clip_high`` left at ``auto`` are the
loss's own (its params class), an explicit number or null is kept, and the objective the module
binds clips with the resolved values."""

from __future__ import annotations

import dataclasses

import pytest

from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.losses.policy import CISPOParams, ClipParams, GSPOParams
from rlhf_lightning.run.validation import validate
from tests.conftest import FAST, compose_config


def resolved(*overrides: str):
    cfg = compose_config(list(overrides))
    validate(cfg)
    return cfg.algo.clip_low, cfg.algo.clip_high


def defaults(params) -> tuple:
    d = {f.name: f.default for f in dataclasses.fields(params)}
    return d["clip_low"], d["clip_high"]


def test_grpo_with_the_gspo_loss_clips_as_gspo():
    assert defaults(GSPOParams) == (3e-4, 4e-4)  # GSPO's paper, sec. 5.1
    assert resolved("algo=grpo", "algo.loss=gspo") == (3e-4, 4e-4)
    assert resolved("algo=gspo") == (3e-4, 4e-4)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["algo=grpo"], defaults(ClipParams)),  # 0.2 / 0.2
        (["algo=ppo"], defaults(ClipParams)),  # PPO's loss is ppo_clip
        (["algo=cispo"], defaults(CISPOParams)),  # no lower bound, cap 4.0
        (["algo=grpo", "algo.loss=cispo"], (None, 4.0)),
        (["algo=gspo", "algo.loss=ppo_clip"], (0.2, 0.2)),
        (["algo=dapo"], (0.2, 0.28)),  # DAPO's clip-higher: set by its preset, kept
        (["algo=dapo", "algo.loss=gspo"], (0.2, 0.28)),  # an explicit value is never replaced
        (["algo=rloo"], (None, None)),  # the reinforce loss has no clip bounds
        (["algo=gspo", "algo.clip_high=5e-4"], (3e-4, 5e-4)),
        (["algo=grpo", "algo.clip_low=null"], (None, 0.2)),  # null: no bound
    ],
)
def test_auto_bounds_are_the_losses_own_and_explicit_values_win(overrides, expected):
    assert resolved(*overrides) == expected


def test_a_bad_bound_is_named():
    with pytest.raises(ConfigError, match=r"algo\.clip_high"):
        resolved("algo=grpo", "algo.clip_high=wide")


@pytest.mark.slow
def test_the_module_binds_the_resolved_bounds(tmp_path):
    from rlhf_lightning.run import build

    cfg = compose_config([*FAST, "algo=grpo", "algo.loss=gspo"], output_dir=tmp_path / "run")
    module, _ = build(cfg, tmp_path)
    term = module.learner.objective(module.schedule.members[0]).term
    assert term.name == "gspo"
    assert (term.kwargs["clip_low"], term.kwargs["clip_high"]) == (3e-4, 4e-4)
