"""Start-up checks of ``rollout.mode=async``: its own fields (before any heavy import) and what
the producer process does not support (the whole validation), each naming its field."""

from __future__ import annotations

import pytest
import torch

from rlhf_lightning.config.early import early_checks
from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.run.validation import validate, validate_producer_devices
from tests.conftest import FAST, compose_config

ASYNC = "rollout.mode=async"


@pytest.mark.parametrize(
    ("overrides", "field", "value"),
    [
        (["rollout.mode=foo"], "rollout.mode", "foo"),
        ([ASYNC, "rollout.max_staleness=-1"], "rollout.max_staleness", -1),
        (["rollout.partial=true"], "rollout.partial", True),  # the default mode: sync
        ([ASYNC, "rollout.producer_threads=0"], "rollout.producer_threads", 0),
        ([ASYNC, "rollout.async_timeout_s=0"], "rollout.async_timeout_s", 0),
        (["rollout.devices=[1]"], "rollout.devices", [1]),  # the default mode: sync
        ([ASYNC, "rollout.devices=[]"], "rollout.devices", []),
        ([ASYNC, "rollout.devices=[-1]"], "rollout.devices", [-1]),
        ([ASYNC, "rollout.devices=[1,1]"], "rollout.devices", [1, 1]),
    ],
)
def test_async_fields_fail_early_naming_the_field(overrides, field, value):
    cfg = compose_config(overrides)
    with pytest.raises(ConfigError, match=rf"invalid config: {field}=") as err:
        early_checks(cfg)
    assert err.value.field == field and err.value.value == value


def test_async_fields_at_their_bounds_pass_early():
    cfg = compose_config(
        [ASYNC, "rollout.max_staleness=0", "rollout.partial=true", "rollout.producer_threads=1"]
    )
    early_checks(cfg)
    early_checks(compose_config([ASYNC, "rollout.producer_threads=null", "rollout.async_timeout_s=0.5"]))


@pytest.mark.parametrize(
    ("overrides", "field", "value"),
    [
        (
            [*FAST, "rollout=vllm", "rollout.offload_trainer_during_rollout=true"],
            "rollout.offload_trainer_during_rollout",
            True,
        ),
        ([*FAST, "strategy=fsdp"], "strategy", "fsdp"),
        ([*FAST, "population.size=2"], "population.size", 2),
        (["algo=sft"], "rollout.mode", "async"),  # trains on a dataset: no rollouts to overlap
    ],
)
def test_what_the_producer_does_not_support_is_refused(tmp_path, overrides, field, value):
    # Each config passes the whole validation in sync mode, so the refusal is async's own.
    validate(compose_config(overrides, output_dir=tmp_path / "sync"))
    cfg = compose_config([*overrides, ASYNC], output_dir=tmp_path / "async")
    with pytest.raises(ConfigError, match=r"rollout\.mode=async|there are no rollouts") as err:
        validate(cfg)
    assert err.value.field == field and err.value.value == value


def test_sync_and_async_defaults_pass(tmp_path):
    validate(compose_config(FAST, output_dir=tmp_path / "sync"))
    validate(compose_config([*FAST, ASYNC], output_dir=tmp_path / "async"))
    validate(compose_config([*FAST, ASYNC, "rollout.max_staleness=0"], output_dir=tmp_path / "k0"))
    validate(compose_config([*FAST, ASYNC, "rollout.partial=true", "env=guess_number"], tmp_path / "p"))
    validate(compose_config([*FAST, ASYNC, "rollout=vllm"], output_dir=tmp_path / "vllm"))  # a vLLM producer


@pytest.mark.parametrize(
    ("overrides", "visible", "match"),
    [
        (["rollout.devices=[1]"], 0, "null on a machine without CUDA devices"),
        (["rollout.devices=[2]", "trainer.devices=1"], 2, "indices below 2"),
        (["rollout.devices=[0]", "trainer.devices=1"], 2, r"trains on \[0\]"),  # training's own
        (["rollout.devices=[1]"], 2, r"trainer.devices=auto trains on \[0, 1\]"),  # auto: all of them
        (["rollout.devices=[1]", "trainer.devices=[1]"], 2, r"trains on \[1\]"),
        (["rollout.devices=[2]", "trainer.devices=2"], 4, r"one device per rank: 2 ranks"),
        (["rollout.devices=[1]", "trainer.devices=1", "trainer.num_nodes=2"], 2, "on one machine"),
    ],
)
def test_producer_devices_must_exist_be_unused_by_training_and_one_per_rank(overrides, visible, match):
    cfg = compose_config([*FAST, ASYNC, *overrides])
    early_checks(cfg)  # the fields alone are fine
    with pytest.raises(ConfigError, match=match) as err:
        validate_producer_devices(cfg, visible=visible)
    assert err.value.field in ("rollout.devices", "trainer.num_nodes")


def test_producer_devices_beside_trainings_pass():
    validate_producer_devices(compose_config([*FAST, ASYNC]), visible=0)  # null: the trainer's device
    for overrides, visible in (
        (["rollout.devices=[1]", "trainer.devices=1"], 2),
        (["rollout.devices=[2,3]", "trainer.devices=2"], 4),
        (["rollout.devices=[0,1]", "trainer.devices=[2,3]"], 4),
    ):
        validate_producer_devices(compose_config([*FAST, ASYNC, *overrides]), visible=visible)


def test_producer_devices_are_checked_by_the_whole_validation(tmp_path):
    """On this machine (no CUDA device) any rollout.devices is refused by ``validate`` itself."""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA devices")
    with pytest.raises(ConfigError, match="without CUDA devices") as err:
        validate(compose_config([*FAST, ASYNC, "rollout.devices=[1]"], output_dir=tmp_path / "d"))
    assert err.value.field == "rollout.devices" and err.value.value == [1]


def test_an_objective_without_a_ratio_is_refused_under_staleness(tmp_path):
    """algo.loss=reinforce has no importance ratio: stale batches would be followed uncorrected.
    Lockstep (max_staleness=0) trains on fresh batches only, so it is allowed there."""
    reinforce = [*FAST, "algo.loss=reinforce"]
    validate(compose_config(reinforce, output_dir=tmp_path / "sync"))
    validate(compose_config([*reinforce, ASYNC, "rollout.max_staleness=0"], output_dir=tmp_path / "k0"))
    with pytest.raises(ConfigError, match="an objective with an importance ratio") as err:
        validate(compose_config([*reinforce, ASYNC], output_dir=tmp_path / "k1"))
    assert err.value.field == "algo.loss" and err.value.value == "reinforce"
