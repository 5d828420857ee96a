"""A policy loss with its own hyper-parameter is one file outside the package: the module
registers the loss with its params class; ``algo.loss=<module>.<name>`` imports it and
``algo.loss_kwargs`` sets the hyper-parameter. It trains, and a bad key is named at start-up."""

from __future__ import annotations

import sys

import pytest
import torch

from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.losses.policy import POLICY_LOSSES
from rlhf_lightning.run.validation import validate
from tests.conftest import FAST, compose_config, fit_steps
from tests.conftest import USER_LOSS_MODULE as MODULE


@pytest.mark.slow
def test_a_loss_from_outside_the_package_trains_with_its_own_hyper_parameter(tmp_path, user_loss_module):
    cfg = compose_config(
        [*FAST, f"algo.loss={MODULE}.scaled_pg", "+algo.loss_kwargs.scale=0.5", "samples.every_n_steps=0"],
        output_dir=tmp_path / "run",
    )
    validate(cfg)
    initial: dict[str, torch.Tensor] = {}

    def hook(module):
        initial.update(
            {n: p.detach().clone() for n, p in module.policy.named_parameters() if p.requires_grad}
        )

    module, trainer = fit_steps(cfg, tmp_path, steps=2, module_hook=hook)
    seen = sys.modules[MODULE].SEEN
    assert trainer.global_step == 2 and seen and set(seen) == {0.5}
    # the dotted name is an alias of the registered entry, not a second loss
    assert f"{MODULE}.scaled_pg" in POLICY_LOSSES and "scaled_pg" in POLICY_LOSSES.names()
    assert len(POLICY_LOSSES) == len(POLICY_LOSSES.names()) == len(list(POLICY_LOSSES))
    moved = [
        n for n, p in module.policy.named_parameters() if n in initial and not torch.equal(p, initial[n])
    ]
    assert moved


def test_an_unknown_hyper_parameter_is_named(user_loss_module):
    with pytest.raises(ConfigError) as err:
        validate(compose_config([f"algo.loss={MODULE}.scaled_pg", "+algo.loss_kwargs.alpha=2"]))
    assert str(err.value).startswith("invalid config: algo.loss_kwargs.alpha=2")
    assert "ScaledParams" in str(err.value) and "scale" in str(err.value)


def test_a_dotted_loss_that_does_not_import_is_named():
    with pytest.raises(ConfigError, match=r"algo\.loss='no_such_pkg\.my_loss'"):
        validate(compose_config(["algo.loss=no_such_pkg.my_loss"]))
