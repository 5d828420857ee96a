"""env=agent end to end: ``run(cfg)`` trains 3 steps of GRPO on examples/agent_calc (an agent
written with the ``openai`` client: multi-turn, a calculator tool), evaluating on held-out tasks;
the refusals that come before any model loads."""

from __future__ import annotations

import csv
import sys

import pytest

from rlhf_lightning.config.errors import ConfigError
from tests.conftest import compose_config

AGENT = [
    "env=agent",
    "model=tiny_tools",
    "env.kwargs.agent=examples.agent_calc.agent:solve",
    "env.kwargs.data.path=examples/agent_calc/tasks.jsonl",
    "algo.prompts_per_step=4",
    "algo.group_size=4",
    "rollout.max_new_tokens=64",
    "env.eval_size=16",
    "eval.batch_size=16",
    "trainer.enable_progress_bar=false",
    "env.concurrency=4",
]


@pytest.mark.slow
def test_an_openai_client_agent_trains_three_steps_and_is_evaluated(tmp_path):
    from rlhf_lightning.run import run

    out = tmp_path / "run"
    cfg = compose_config([*AGENT, "trainer.max_steps=3", "trainer.val_check_interval=3"], output_dir=out)
    result = run(cfg)
    assert result.exit_code == 0 and result.trainer.global_step == 3
    with (out / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    train = [r for r in rows if r.get("rollout/reward_mean")]
    assert [r["step"] for r in train] == ["1", "2", "3"]
    for r in train:
        assert float(r["agent/calls_per_episode"]) >= 1.0 and float(r["env/reward_errors"]) == 0.0
        # 16 episodes' calls served in far fewer batched engine calls
        assert float(r["agent/engine_calls"]) < 16 * float(r["agent/calls_per_episode"])
    evals = [r for r in rows if r.get("eval/accuracy_greedy")]
    assert evals and all(0.0 <= float(r["eval/accuracy_greedy"]) <= 1.0 for r in evals)
    assert not result.module.harness.endpoint._thread  # the endpoint stopped with the run


def test_a_missing_extra_is_refused_naming_it(monkeypatch):
    from rlhf_lightning.envs.agent import AgentEnv

    monkeypatch.setitem(sys.modules, "openai", None)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "openai" else object())
    with pytest.raises(ConfigError, match=r'env\.kwargs\.agent.*pip install -e "\.\[agent\]"'):
        AgentEnv(
            "examples.agent_calc.agent:solve",
            {"path": "examples/agent_calc/tasks.jsonl", "scorer": "integer"},
        )


def test_held_out_tasks_are_not_training_tasks():
    from rlhf_lightning.envs.agent import AgentEnv

    env = AgentEnv(
        "examples.agent_calc.agent:solve", {"path": "examples/agent_calc/tasks.jsonl", "scorer": "integer"}
    )
    train = {env.task(i, False)[1]["question"] for i in range(env.num_rows(False))}
    held = [env.task(i, True)[1] for i in range(env.num_rows(True))]
    assert env.num_rows(True) == 200 and env.num_rows(False) == 1800
    assert not train & {t["question"] for t in held}  # every question is distinct in the file
    assert all(str(t["gold"]) == t["answer"] for t in held)


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["population.size=2", "population.batched=true"], "population.batched"),
    ],
)
def test_what_env_agent_does_not_support_yet_is_refused_early(overrides, field):
    from rlhf_lightning.run.validation import validate

    cfg = compose_config([*AGENT, *overrides])
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        validate(cfg)


def test_a_bad_task_file_is_named_under_env_kwargs_data():
    from rlhf_lightning.envs.agent import AgentEnv

    with pytest.raises(ConfigError, match=r"env\.kwargs\.data\.path='nowhere\.jsonl': an existing file"):
        AgentEnv("examples.agent_calc.agent:solve", {"path": "nowhere.jsonl", "scorer": "integer"})


@pytest.mark.slow
def test_ppo_trains_on_agent_episodes_with_a_value_per_call(tmp_path):
    from rlhf_lightning.run import run

    out = tmp_path / "ppo"
    cfg = compose_config(
        [
            *AGENT,
            "algo=ppo",
            "algo.prompts_per_step=2",
            "trainer.max_steps=2",
            "trainer.val_check_interval=100",
        ],
        output_dir=out,
    )
    assert run(cfg).exit_code == 0
    with (out / "metrics.csv").open() as f:
        train = [r for r in csv.DictReader(f) if r.get("rollout/reward_mean")]
    assert len(train) == 2
    # the calculator agent's episodes have two calls: two turn-level steps, each with its value
    assert all(r.get("critic/value_turn_0") and r.get("critic/value_turn_1") for r in train)
