"""A PPO checkpoint written before the Learner redesign kept the critic warm-up counter as the
module's ``ppo_learn_steps``; resuming from it continues the count (as a flat ``guard`` entry of
that era still becomes the guard record), instead of starting the critic warm-up again."""

from __future__ import annotations

from rlhf_lightning.algorithms.ppo import PPOModule, warming_up
from rlhf_lightning.run import build
from tests.conftest import FAST, compose_config


def ppo_module(tmp_path, *extra: str) -> PPOModule:
    cfg = compose_config(
        [*FAST, "algo=ppo", "algo.critic_warmup_steps=2", *extra], output_dir=tmp_path / "run"
    )
    module, _ = build(cfg, tmp_path)
    assert isinstance(module, PPOModule)
    return module


def old_checkpoint(learn_steps: int) -> dict:
    """What ``PPOModule.on_save_checkpoint`` wrote before the redesign (commit 0aa47e0): the
    counter at the top level, one flat guard record, no ``member_states``."""
    return {
        "global_step": learn_steps,
        "state_dict": {},
        "trainable_only": True,
        "guard": {"nonfinite_streak": 1, "skipped_steps": 2},
        "ppo_learn_steps": learn_steps,
    }


def test_an_old_checkpoints_warm_up_counter_is_read(tmp_path):
    module = ppo_module(tmp_path)
    (member,) = module.schedule.members
    assert member.state == {"learn_steps": 0} and warming_up(member)
    module.on_load_checkpoint(old_checkpoint(3))
    assert member.state["learn_steps"] == 3
    assert not warming_up(member)  # 3 steps done, warm-up of 2 over: the actor trains again
    assert (member.health.nonfinite_streak, member.health.skipped_steps) == (1, 2)  # the guard's legacy read


def test_a_new_checkpoints_member_states_win(tmp_path):
    module = ppo_module(tmp_path)
    (member,) = module.schedule.members
    module.on_load_checkpoint({"global_step": 1, "member_states": [{"learn_steps": 1}]})
    assert member.state == {"learn_steps": 1} and warming_up(member)
