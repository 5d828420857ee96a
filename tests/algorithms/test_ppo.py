"""PPO: critic warm-up, critic/actor parameter groups, multi-turn runs, exported critic."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel

from rlhf_lightning.models.build import load_model
from rlhf_lightning.run import run
from tests.conftest import FAST, compose_config, fit_steps


def ppo_cfg(tmp_path, *extra):
    return compose_config(
        [*FAST, "algo=ppo", "algo.prompts_per_step=4", "algo.group_size=4", *extra],
        output_dir=tmp_path / "run",
    )


def record_levels(levels: list):
    """A ``fit_steps`` hook that records each step's ``Scored.level`` (turn | token)."""

    def hook(module):
        original = module.learner.score

        def spy(*args, **kwargs):
            scored = original(*args, **kwargs)
            levels.append(scored.level)
            return scored

        module.learner.score = spy

    return hook


@pytest.mark.slow
def test_critic_warmup_leaves_the_actor_bit_identical(tmp_path):
    cfg = ppo_cfg(tmp_path, "algo.critic_warmup_steps=3", "algo.lr=1e-2", "algo.lr_critic=1e-2")
    start: dict[str, list[torch.Tensor]] = {}

    def snapshot(module):
        start["actor"] = [p.detach().clone() for p in module.policy.trainable_parameters("actor")]
        start["critic"] = [p.detach().clone() for p in module.policy.trainable_parameters("critic")]

    module, _ = fit_steps(cfg, tmp_path, steps=3, module_hook=snapshot)
    actor = module.policy.trainable_parameters("actor")
    critic = module.policy.trainable_parameters("critic")
    assert actor and critic and {id(p) for p in actor}.isdisjoint(id(p) for p in critic)
    assert all(torch.equal(a, b) for a, b in zip(actor, start["actor"])), (
        "the actor moved during critic warm-up"
    )
    assert any(not torch.equal(a, b) for a, b in zip(critic, start["critic"])), "the critic did not learn"
    assert module.schedule.members[0].state["learn_steps"] == 3
    module, _ = fit_steps(cfg, tmp_path, steps=5, module_hook=snapshot)
    moved = [
        not torch.equal(a, b) for a, b in zip(module.policy.trainable_parameters("actor"), start["actor"])
    ]
    assert any(moved), "the actor never trained after warm-up"


@pytest.mark.slow
def test_ppo_multi_turn_guess_number_runs(tmp_path):
    overrides = [o for o in FAST if not o.startswith("env.kwargs")]
    cfg = compose_config(
        [
            *overrides,
            "algo=ppo",
            "env=guess_number",
            "env.max_turns=3",
            "algo.prompts_per_step=4",
            "algo.group_size=4",
            "algo.critic_warmup_steps=0",
            "rollout.max_new_tokens=6",
        ],
        output_dir=tmp_path / "run",
    )
    levels: list = []
    _, trainer = fit_steps(cfg, tmp_path, steps=2, module_hook=record_levels(levels))
    m = trainer.callback_metrics
    for key in ("critic/value_loss", "critic/explained_variance", "critic/value_mean", "actor/clipfrac"):
        assert key in m, key
    assert levels == ["turn", "turn"]  # the steps GAE ran over, as scoring recorded them
    # turn-level diagnostics: one value/advantage/reward mean per turn reached
    turns = [k for k in ("critic/value_turn_0", "critic/adv_turn_0", "rollout/reward_turn_0") if k in m]
    assert len(turns) == 3 and "rollout/env_ended_frac" in m
    assert ("critic/value_turn_1" in m) == (float(m["rollout/num_turns"]) > 1)


@pytest.mark.slow
def test_ppo_token_level_gae_runs_on_multi_turn_episodes(tmp_path):
    """advantage_granularity=token on multi-turn episodes: one GAE over the action tokens of all
    turns, each turn's reward on its last token (the turn-level ablation's other arm)."""
    overrides = [o for o in FAST if not o.startswith("env.kwargs")]
    cfg = compose_config(
        [
            *overrides,
            "experiment=guess_number",
            "algo=ppo",
            "algo.advantage_granularity=token",
            "algo.prompts_per_step=4",
            "algo.group_size=4",
            "algo.critic_warmup_steps=0",
        ],
        output_dir=tmp_path / "run",
    )
    levels: list = []
    _, trainer = fit_steps(cfg, tmp_path, steps=2, module_hook=record_levels(levels))
    m = trainer.callback_metrics
    assert levels == ["token", "token"] and float(m["rollout/num_turns"]) >= 2
    assert torch.isfinite(m["critic/value_loss"]) and torch.isfinite(m["actor/loss"])
    assert "critic/value_turn_0" not in m  # per-turn values are a turn-level diagnostic


@pytest.mark.slow
def test_ppo_exports_actor_and_critic_adapters(tmp_path):
    cfg = ppo_cfg(tmp_path, "algo.critic_warmup_steps=0", "checkpoint.every_n_steps=2", "trainer.max_steps=2")
    result = run(cfg)
    adapters = result.output_dir / "checkpoints" / "adapters" / "last"
    assert (adapters / "actor" / "adapter_config.json").is_file()
    assert (adapters / "critic" / "adapter_config.json").is_file()
    assert (adapters / "critic" / "value_head.safetensors").is_file()
    PeftModel.from_pretrained(load_model(cfg.model.path, dtype="float32"), str(adapters / "critic"))
