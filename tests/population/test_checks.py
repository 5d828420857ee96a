"""Start-up checks of population.*: ranges that allow values a member cannot train with, hyper-
parameters the algorithm does not use, and strategies a population cannot run under, refused
with the field, the value and the fix; mutated values checked by the same rules."""

from __future__ import annotations

import random
import re
from types import SimpleNamespace

import pytest

from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.population.callback import Population
from rlhf_lightning.population.checks import check_member, side_by_side, value_problem
from rlhf_lightning.population.evolution import MutationRange, mutate
from rlhf_lightning.population.side_by_side import SideBySidePopulation
from rlhf_lightning.run.factories import population_callback
from rlhf_lightning.run.validation import validate
from tests.conftest import FAST, compose_config

POP = [*FAST, "population.size=2", "population.evolve_every=2"]  # prompts_per_step=4, group_size=4


def refused(tmp_path, *overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        validate(compose_config([*POP, *overrides], output_dir=tmp_path))
    return str(err.value)


def test_population_under_fsdp_is_refused_with_the_fix(tmp_path):
    msg = refused(tmp_path, "strategy=fsdp")
    assert "strategy.name='fsdp'" in msg and "population.size=2" in msg and "use strategy=ddp" in msg
    validate(compose_config([*POP, "strategy=ddp"], output_dir=tmp_path))  # ddp is fine


def test_members_go_side_by_side_unless_the_run_needs_round_robin(tmp_path):
    """population.batched=null (the default): side by side with LoRA members, round-robin for full
    fine-tuning and dynamic sampling, which side by side does not cover; an explicit value wins."""

    def composed(*overrides: str):
        cfg = compose_config([*POP, *overrides], output_dir=tmp_path)
        validate(cfg)  # each of these runs is accepted
        return cfg

    assert side_by_side(cfg := composed())
    assert type(population_callback(cfg, tmp_path)) is SideBySidePopulation
    for overrides in [
        ("model.finetune=full",),
        ("algo.dynamic_sampling=true",),
        ("population.batched=false",),
    ]:
        assert not side_by_side(cfg := composed(*overrides)), overrides
        assert type(population_callback(cfg, tmp_path)) is Population
    msg = refused(tmp_path, "population.batched=true", "model.finetune=full")
    assert "model.finetune='full'" in msg and "population.batched=false" in msg


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        ("{group_size:{low:1,high:8,scale:2}}", r"allows group_size=1.*integer >= 2"),
        ("{group_size:{low:0,high:8,scale:2}}", r"allows group_size=0.*integer >= 2"),
        ("{group_size:{low:2.5,high:8,scale:2}}", r"integer low and high"),
        ("{lr:{low:0,high:0.1,scale:2}}", r"allows lr=0.*learning rate > 0"),
        ("{clip_low:{low:0.1,high:1.0,scale:1.5}}", r"allows clip_low=1.*\[0, 1\)"),
        ("{temperature:{low:0,high:1.5,scale:1.2}}", r"allows temperature=0.*temperature > 0"),
        ("{entropy_coef:{low:0,high:0.1,scale:2}}", r"algo=grpo has no entropy_coef"),
    ],
    ids=[
        "group_size_1",
        "group_size_0",
        "group_size_float",
        "lr_0",
        "clip_low_1",
        "temperature_0",
        "entropy",
    ],
)
def test_mutation_ranges_that_allow_invalid_values_are_refused(tmp_path, mutate, expected):
    msg = refused(tmp_path, f"population.mutate={mutate}")
    assert msg.startswith(f"invalid config: population.mutate.{mutate[1:].split(':')[0]}=")
    assert re.search(expected, msg), msg


def test_hyper_parameters_the_objective_does_not_use_are_refused(tmp_path):
    msg = refused(tmp_path, "algo=cispo", "population.mutate={clip_low:{low:0.1,high:0.3,scale:1.5}}")
    assert "population.mutate.clip_low" in msg and "algo.clip_low is null" in msg
    msg = refused(tmp_path, "algo=rloo", "population.mutate={clip_high:{low:0.1,high:0.3,scale:1.5}}")
    assert "algo.loss=reinforce does not use clip_high" in msg
    msg = refused(tmp_path, "model.finetune=full", "population.mutate={beta:{low:0.01,high:0.1,scale:2}}")
    assert "builds no reference model" in msg
    # What they do use is accepted: CISPO's upper bound, PPO's entropy bonus.
    for algo, space in [
        ("algo=cispo", "{clip_high:{low:2,high:6,scale:1.5}}"),
        ("algo=ppo", "{entropy_coef:{low:0,high:0.01,scale:2},clip_low:{low:0.1,high:0.3,scale:1.5}}"),
    ]:
        validate(compose_config([*POP, algo, f"population.mutate={space}"], output_dir=tmp_path))


def test_group_size_mutation_must_keep_the_batch_geometry(tmp_path):
    space = "population.mutate={group_size:{low:2,high:8,scale:2}}"
    # A mini-batch size fixes the optimizer steps per step only at the config's group size.
    msg = refused(tmp_path, space, "algo.mini_batch_size=8")
    assert "allows group_size=2" in msg and "algo.mini_batch_size=8" in msg and "mini_batch_size=null" in msg
    # 4 prompts x 3 = 12 rollouts do not split into micro-batches of 8.
    msg = refused(tmp_path, space, "algo.micro_batch_size=8")
    assert "allows group_size=3" in msg and "micro_batch_size=8 must divide" in msg and "= 12" in msg
    # Micro-batches of 4 divide 4 x g for every g; a fixed group size with a mini-batch is fine.
    validate(compose_config([*POP, space, "algo.micro_batch_size=4"], output_dir=tmp_path))
    validate(
        compose_config(
            [
                *POP,
                "population.mutate={group_size:{low:4,high:4,scale:2}}",
                "algo.mini_batch_size=8",
                "trainer.max_steps=4",  # 2 members x 2 optimizer steps a population step
            ],
            output_dir=tmp_path,
        )
    )


def test_value_rules_are_the_start_up_rules():
    algo = {"prompts_per_step": 4, "group_size": 4, "mini_batch_size": None, "micro_batch_size": 8}
    assert value_problem("group_size", 4, algo) is None
    assert "must divide" in str(value_problem("group_size", 3, algo))  # 12 rollouts, micro 8
    assert value_problem("group_size", 6, algo, world_size=2) is None  # 2 x 6 rows per rank, micro 4 per rank
    assert "integer >= 2" in str(value_problem("group_size", 1, algo))
    assert value_problem("clip_low", 0.0, algo) is None and value_problem("clip_low", 1.0, algo)
    with pytest.raises(ConfigError, match=r"population\.mutate\.group_size=1: member 7 was mutated"):
        check_member({"lr": 1e-3, "group_size": 1}, algo, 1, 7)
    check_member({"lr": 1e-3, "group_size": 2, "temperature": 0.7}, algo, 1, 7)


def test_a_mutation_to_an_invalid_value_never_reaches_a_member():
    """Even where the range was not checked (a callback built by hand), the mutated value is."""
    space = {"group_size": MutationRange(1, 8, 2.0)}
    pop = Population(2, 2, space, "/tmp/unused")
    pop.module = SimpleNamespace(world_size=1)
    pop._algo = {"prompts_per_step": 4, "group_size": 4}
    # A seed whose mutation halves 2 to 1 (no group to compare within), found with the pure function.
    seed = next(
        s for s in range(100) if mutate({"group_size": 2}, space, random.Random(s), 0.0)[0]["group_size"] == 1
    )
    pop.rng = random.Random(seed)
    with pytest.raises(ConfigError, match=r"population\.mutate\.group_size=1: member 3 .*integer >= 2"):
        pop.mutated({"group_size": 2}, 3, 0.0)
    pop.rng = random.Random(seed + 1000)
    assert pop.mutated({"group_size": 4}, 3, 0.0)[0]["group_size"] in (2, 8)  # valid values pass
