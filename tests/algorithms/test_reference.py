"""``algo.ref_update_interval``: one implementation for every family (the shared optimizer step)."""

from __future__ import annotations

import pytest
import torch

from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.run.validation import validate
from tests.conftest import FAST, compose_config, fit_steps

QUICK = [o for o in FAST if not o.startswith("algo.")]

FAMILIES = {
    "dpo": ["algo=dpo", "algo.batch_size=8", "algo.env_eval=false"],
    "grpo": ["algo=grpo", "algo.beta=0.1", "algo.prompts_per_step=4", "algo.group_size=4"],
    "ppo": [
        "algo=ppo",
        "algo.beta=0.1",
        "algo.prompts_per_step=4",
        "algo.group_size=4",
        "algo.critic_warmup_steps=0",
    ],
}


def actor_equals_reference(policy) -> bool:
    params = dict(policy.named_parameters())
    pairs = [(p, params[n.replace(".actor.", ".reference.")]) for n, p in params.items() if ".actor." in n]
    assert pairs, "no actor adapter"
    return all(torch.equal(a, r) for a, r in pairs)


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_reference_equals_actor_right_after_each_refresh(tmp_path, family):
    cfg = compose_config(
        [
            *QUICK,
            *FAMILIES[family],
            "algo.use_separate_reference_adapter=true",
            "algo.ref_update_interval=2",
            "algo.lr=1e-2",
        ],
        output_dir=tmp_path / "run",
    )
    validate(cfg)
    seen: list[bool] = []

    def hook(module):
        original = module.stepper.refresh_reference  # after every optimizer step

        def spy(interval, done):
            original(interval, done)
            seen.append(actor_equals_reference(module.policy))

        module.stepper.refresh_reference = spy

    fit_steps(cfg, tmp_path, steps=4, module_hook=hook)
    # after optimizer steps 1..4: refreshed at 2 and 4, moved away in between
    assert seen == [False, True, False, True]


@pytest.mark.parametrize(
    "extra",
    [
        ["algo=grpo", "algo.ref_update_interval=2"],  # beta = 0: no reference is used
        ["algo=grpo", "algo.beta=0.1", "algo.ref_update_interval=2"],  # the base cannot move
        ["algo=dpo", "algo.ref_update_interval=1"],
    ],
)
def test_a_reference_that_cannot_move_is_refused(tmp_path, extra):
    cfg = compose_config([*QUICK, *extra], output_dir=tmp_path / "run")
    with pytest.raises(ConfigError, match=r"algo\.ref_update_interval"):
        validate(cfg)
