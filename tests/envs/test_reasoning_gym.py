"""env=reasoning_gym: reasoning-gym's problems, prompt and scorer; splits that never share an item."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

pytest.importorskip(
    "reasoning_gym", reason="needs the reasoning_gym extra: pip install 'rlhf_lightning[reasoning_gym]'"
)

import reasoning_gym as rg
from reasoning_gym.utils import SYSTEM_PROMPTS, extract_answer

from rlhf_lightning.algorithms.evaluation import episode_success
from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.envs.base import TextEnv
from rlhf_lightning.envs.factory import env_factory
from rlhf_lightning.envs.reasoning_gym import ReasoningGymEnv
from tests.conftest import fit_recording

TARGET = "rlhf_lightning.envs.reasoning_gym.ReasoningGymEnv"


def test_prompt_is_reasoning_gyms_system_prompt_and_question():
    env = ReasoningGymEnv(task="chain_sum", train_size=50, eval_size=10)
    assert isinstance(env, TextEnv)
    obs, info = env.reset(row_index=3)
    expected = rg.create_dataset("chain_sum", size=60, seed=0)[3]
    assert obs == [
        {"role": "system", "content": SYSTEM_PROMPTS["default"]},
        {"role": "user", "content": expected["question"]},
    ]
    assert "<answer>answer here</answer>" in SYSTEM_PROMPTS["default"]
    assert info["answer"] == expected["answer"] and info["index"] == 3
    bare, _ = ReasoningGymEnv(task="chain_sum", train_size=50, eval_size=10, system_prompt=None).reset(
        row_index=3
    )
    assert bare == expected["question"]


@pytest.mark.parametrize("task", ["basic_arithmetic", "letter_counting"])
def test_rewards_are_the_tasks_own_scores(task):
    """Replies scored by the env equal ``score_answer(extract_answer(reply), item)`` computed on a
    dataset built here; full marks for the gold answer, 0 without an answer block."""
    env = ReasoningGymEnv(task=task, train_size=40, eval_size=10)
    ds = rg.create_dataset(task, size=50, seed=0)
    for row in range(10):
        entry = ds[40 + row]
        gold = str(entry["answer"])
        for reply, score in (
            (f"Thinking... <answer> {gold} </answer>", 1.0),
            (f"<answer>{gold}</answer> no, <answer>{gold}0</answer>", None),  # the last block counts
            (f"The answer is {gold}.", 0.0),
        ):
            env.reset(row_index=row, evaluation=True)
            obs, reward, terminated, truncated, step_info = env.step(reply)
            expected = ds.score_answer(extract_answer(reply), entry)
            assert reward == expected and (score is None or reward == score)
            assert (obs, terminated, truncated) == ("", True, False)
            assert step_info == {"score": reward, "correct": reward >= 1.0, "answered": "<answer>" in reply}
            success = episode_success(SimpleNamespace(infos=[step_info], rewards=[reward]))
            assert success == float(reward == 1.0)  # evaluation's accuracy reads info["correct"]


def test_correct_threshold_counts_partial_scores():
    env = ReasoningGymEnv(task="basic_arithmetic", train_size=10, eval_size=5, correct_threshold=0.5)
    _, info = env.reset(row_index=0)
    partial = f"<answer>{info['answer']}0</answer>"  # the gold answer inside a longer one
    score = rg.create_dataset("basic_arithmetic", size=15, seed=0).score_answer(extract_answer(partial), info)
    *_, step_info = env.step(partial)
    assert step_info["score"] == score and step_info["correct"] == (score >= 0.5)


def test_train_and_eval_rows_are_different_items():
    """Train row i is item i, eval row j item train_size + j: the index sets never meet. The
    question texts can repeat across items of a small question space: measured here."""
    env = ReasoningGymEnv(task="chain_sum", train_size=5000, eval_size=200, seed=3)
    train = [env.reset(row_index=i)[1] for i in range(5000)]
    evals = [env.reset(row_index=j, evaluation=True)[1] for j in range(200)]
    assert [t["index"] for t in train] == list(range(5000))
    assert [e["index"] for e in evals] == list(range(5000, 5200))
    ds = rg.create_dataset("chain_sum", size=5200, seed=3)
    assert [e["question"] for e in evals] == [ds[5000 + j]["question"] for j in range(200)]
    assert (
        env.reset(row_index=5003)[1]["index"] == 3
        and env.reset(row_index=201, evaluation=True)[1]["index"] == 5001
    )
    repeated = sum(e["question"] in {t["question"] for t in train} for e in evals)
    assert repeated <= 10, repeated  # 5 of 200 with reasoning-gym 0.1.23 (documented)
    # Two datasets whose seeds differ by one are the same items shifted by one (why one dataset).
    shifted = rg.create_dataset("chain_sum", size=10, seed=4)
    assert [shifted[i]["question"] for i in range(5)] == [ds[i + 1]["question"] for i in range(5)]


def test_an_item_that_fails_to_generate_is_replaced_by_the_next_one():
    ds = rg.create_dataset("basic_arithmetic", size=100_200, seed=0)
    with pytest.raises(ZeroDivisionError):
        ds[75220]  # a reasoning-gym bug at this seed
    env = ReasoningGymEnv(task="basic_arithmetic")
    _, info = env.reset(row_index=75220)
    assert info["index"] == 75221 and info["question"] == ds[75221]["question"]


def test_weighted_mix_through_reasoning_gyms_composite():
    env = ReasoningGymEnv(task=None, tasks={"chain_sum": 2, "gcd": 1}, train_size=300, eval_size=20)
    picks = []
    for row in range(300):
        _, info = env.reset(row_index=row)
        source = info["metadata"]["source_dataset"]
        picks.append(source)
        if row < 20:  # each item scored by its own task's scorer
            reply = f"<answer>{info['answer']}</answer>"
            assert env.step(reply)[1] == 1.0
    share = picks.count("chain_sum") / 300
    assert set(picks) == {"chain_sum", "gcd"} and 0.58 < share < 0.75  # weight 2/3 (3 sd)
    listed = ReasoningGymEnv(
        task=None,
        tasks=[
            {"name": "chain_sum", "weight": 1, "kwargs": {"min_terms": 2, "max_terms": 2}},
            {"name": "gcd"},
        ],
        train_size=50,
        eval_size=5,
    )
    for row in range(50):
        _, info = listed.reset(row_index=row)
        if info["metadata"]["source_dataset"] == "chain_sum":
            assert info["metadata"]["num_terms"] == 2


def test_start_up_errors_name_the_field_and_the_fix(monkeypatch):
    with pytest.raises(ConfigError, match=r"env.kwargs.task='basic_arithmetik'.*close: basic_arithmetic"):
        env_factory(TARGET, {"task": "basic_arithmetik"})
    with pytest.raises(ConfigError, match=r"env.kwargs.task='composite'.*mix tasks with env.kwargs.tasks"):
        ReasoningGymEnv(task="composite")
    with pytest.raises(
        ConfigError,
        match=r"env.kwargs.task_kwargs=\{'max_termz': 3\}.*BasicArithmeticDatasetConfig.*'max_terms'.*unexpected keyword argument 'max_termz'",
    ):
        ReasoningGymEnv(task_kwargs={"max_termz": 3})
    with pytest.raises(
        ConfigError, match=r"env.kwargs.task_kwargs=.*AssertionError: max_terms must be >= min_terms"
    ):
        ReasoningGymEnv(task_kwargs={"min_terms": 5, "max_terms": 2})
    with pytest.raises(ConfigError, match=r"env.kwargs.tasks\[1\].kwargs=\{'foo': 1\}.*GCDConfig"):
        ReasoningGymEnv(task=None, tasks=[{"name": "chain_sum"}, {"name": "gcd", "kwargs": {"foo": 1}}])
    with pytest.raises(ConfigError, match=r"env.kwargs.tasks\[0\].name='chainsum'.*close: chain_sum"):
        ReasoningGymEnv(task=None, tasks={"chainsum": 1})
    with pytest.raises(ConfigError, match=r"env.kwargs.tasks=\{'gcd': 1\}: either env.kwargs.task"):
        ReasoningGymEnv(tasks={"gcd": 1})
    with pytest.raises(ConfigError, match=r"env.kwargs.task_kwargs=\{'seed': 3\}: no seed or size"):
        ReasoningGymEnv(task_kwargs={"seed": 3})
    with pytest.raises(ConfigError, match=r"env.kwargs.system_prompt='plain'.*'default'"):
        ReasoningGymEnv(system_prompt="plain")
    with pytest.raises(
        ConfigError, match=r"word_ladder.*Dataset size too large.*size = train_size \+ eval_size = 100200"
    ):
        ReasoningGymEnv(task="word_ladder")
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # as if reasoning-gym were not installed
    with pytest.raises(
        ConfigError, match=r"env.kwargs.task='gcd'.*pip install 'rlhf_lightning\[reasoning_gym\]'"
    ):
        ReasoningGymEnv(task="gcd")


@pytest.mark.parametrize(
    "overrides",
    [
        ("env.kwargs.task=basic_arithmetic",),
        ("env.kwargs.task=null", "env.kwargs.tasks={chain_sum: 1, gcd: 1}"),
    ],
    ids=["basic_arithmetic", "chain_sum+gcd"],
)
@pytest.mark.slow
def test_three_training_steps_with_tiny_chat_replay_through_reasoning_gym(fast_cfg, tmp_path, overrides):
    """env=reasoning_gym through the real config: 3 GRPO steps of tiny_chat; each reply it
    generated, scored by reasoning-gym directly on the same item, gets the reward we trained on."""
    cfg = fast_cfg("env=reasoning_gym", "model=tiny_chat", "trainer.max_steps=3", *overrides)
    _, _, seen, times = fit_recording(cfg, tmp_path, steps=3)
    kw = cfg.env.kwargs
    size = kw.train_size + kw.eval_size
    if kw.tasks is None:
        ds = rg.create_dataset(kw.task, size=size, seed=kw.seed)
    else:
        from reasoning_gym.composite import DatasetSpec

        specs = [DatasetSpec(name, float(w), {}) for name, w in kw.tasks.items()]
        ds = rg.create_dataset("composite", size=size, seed=kw.seed, datasets=specs)
    assert len(seen) == 3 and len(times) == 3
    for result in seen:
        assert len(result.trajectories) == 16
        for t in result.trajectories:
            entry = ds[t.task_info["index"]]
            assert t.task_info["question"] == entry["question"] and t.num_turns == 1
            assert t.rewards == [ds.score_answer(extract_answer(t.replies[0]), entry)]
    print(f"{'/'.join(overrides)}: step times {[round(x, 2) for x in times]} s")
