"""reward=function: what a user function may return, which signatures it may have, errors that
name it, and copies of the env's columns (a function cannot change the cached dataset)."""

from __future__ import annotations

import json
import re
import sys
import textwrap

import numpy as np
import pytest
import torch

from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.envs.dataset import DatasetEnv
from rlhf_lightning.records.trajectory import Trajectory
from rlhf_lightning.rewards import SIGNATURE, CombinedReward, Episode, FunctionReward, checked_scores

FUNCTIONS = """
import numpy as np
import torch

RETURNS = {}
SEEN = []

def returns(prompts, completions, **kwargs):
    return RETURNS["value"]

def raises(prompts, completions, **kwargs):
    return [1.0 / 0 for _ in completions]

def no_prompts(completions, answer):
    return [0.0 for _ in completions]

def one_argument(x):
    return [0.0]

def positional_only(prompts, completions, /, **kwargs):
    return [0.0 for _ in completions]

def just_two(prompts, completions):
    SEEN.append("just_two")
    return [float(len(c)) for c in completions]

def named_column(prompts, completions, answer):
    return [float(c == str(a)) for c, a in zip(completions, answer)]

def needs_missing(prompts, completions, difficulty):
    return [0.0 for _ in completions]

def appends(prompts, completions, steps, **kwargs):
    SEEN.append([len(s) for s in steps])
    for s in steps:
        s.append(len(s))
    for p in prompts:
        if isinstance(p, list):
            p.append({"role": "user", "content": "injected"})
    return [0.0 for _ in completions]
"""


@pytest.fixture
def fns(tmp_path, monkeypatch):
    """A user module of reward functions, imported fresh."""
    (tmp_path / "user_fns.py").write_text(textwrap.dedent(FUNCTIONS))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("user_fns", None)
    import user_fns

    yield user_fns
    sys.modules.pop("user_fns", None)


EPISODES = [Episode("1+1?", ["2"], {"answer": 2}), Episode("2+2?", ["4"], {"answer": 4})]


@pytest.mark.parametrize(
    "value",
    [[1.0, -0.5], (1, -0.5), np.array([1.0, -0.5], dtype=np.float32), torch.tensor([1.0, -0.5]),
     [np.float64(1.0), torch.tensor(-0.5)]],
)  # fmt: skip
def test_sequences_of_real_numbers_are_accepted(fns, value):
    fns.RETURNS["value"] = value
    assert FunctionReward("user_fns.returns").score(EPISODES, "cpu") == [1.0, -0.5]


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ({0: 1.0, 1: 0.0}, r"it returned a dict: \{0: 1\.0, 1: 0\.0\}"),
        ([True, False], r"2 of its 2 scores are not, the first is score 0: True \(bool\)"),
        (["1.5", 2.0], r"the first is score 0: '1\.5' \(str\)"),
        (np.array([True, False]), r"score 0: np\.True_ \(bool_?\)"),
        ([1.0, float("nan")], r"the first is score 1: nan \(float\)"),
        (np.zeros((2, 1)), r"it returned a ndarray"),
        ("10", r"it returned a str"),
        (iter([1.0, 2.0]), r"it returned a list_iterator"),
    ],
)
def test_anything_else_is_refused_naming_the_function_and_what_is_expected(fns, value, shown):
    fns.RETURNS["value"] = value
    with pytest.raises(TypeError) as err:
        FunctionReward("user_fns.returns").score(EPISODES, "cpu")
    message = str(err.value)
    assert "reward.fn=user_fns.returns must return a list (or tuple, 1-d NumPy array, 1-d tensor)" in message
    assert "of 2 finite real numbers, one per completion (not bools or strings)" in message
    assert re.search(shown, message), message


def test_checked_scores_counts_the_episodes():
    with pytest.raises(ValueError, match=r"src returned 3 scores for 2 episodes"):
        checked_scores([1.0, 2.0, 3.0], 2, "src")


def test_a_function_that_raises_is_named_with_its_exception(fns):
    with pytest.raises(RuntimeError, match=r"reward\.fn=user_fns\.raises \(the reward function raises\) "
                       r"raised ZeroDivisionError: float division by zero while scoring 2 completions"):  # fmt: skip
        FunctionReward("user_fns.raises").score(EPISODES, "cpu")


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("one_argument", r"signature \(x\), which takes no \['prompts', 'completions'\]"),
        ("no_prompts", r"signature \(completions, answer\), which takes no \['prompts'\]"),
        ("positional_only", r"which needs positional-only \['prompts', 'completions'\]"),
    ],
)
def test_a_wrong_signature_is_refused_at_construction(fns, name, problem):
    with pytest.raises(ConfigError) as err:
        FunctionReward(f"user_fns.{name}")
    message = str(err.value)
    assert message.startswith(f"invalid config: reward.fn='user_fns.{name}': a function {SIGNATURE}")
    assert SIGNATURE == "fn(prompts, completions, **kwargs) -> list[float]"
    assert re.search(problem, message), message


def test_without_kwargs_a_function_gets_only_the_arguments_it_names(fns):
    assert FunctionReward("user_fns.just_two").score(EPISODES, "cpu") == [1.0, 1.0]
    assert FunctionReward("user_fns.named_column").score(
        [Episode("q", ["2"], {"answer": 2}), Episode("q", ["5"], {"answer": 4})], "cpu"
    ) == [1.0, 0.0]
    with pytest.raises(ValueError, match=r"takes \['difficulty'\].*the columns are \['answer'\]"):
        FunctionReward("user_fns.needs_missing").score(EPISODES, "cpu")


def test_a_function_that_mutates_its_arguments_changes_nothing_across_calls(fns):
    columns = {"steps": [0, 1]}
    prompt = [{"role": "user", "content": "q"}]
    episodes = [Episode(prompt, ["a"], columns), Episode(prompt, ["b"], columns)]  # shared, like a cached row
    fn = FunctionReward("user_fns.appends")
    for _ in range(3):
        fn.score(episodes, "cpu")
    assert fns.SEEN == [[2, 2], [2, 2], [2, 2]]
    assert columns == {"steps": [0, 1]} and prompt == [{"role": "user", "content": "q"}]


def test_a_mutating_function_cannot_grow_a_dataset_column_over_group_members_and_steps(fns, tmp_path):
    rows = [{"question": f"q{i}", "answer": str(i), "steps": [i]} for i in range(10)]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    reward = CombinedReward([FunctionReward("user_fns.appends")], {}, use_env=True)
    for _ in range(3):  # three steps, a group of 4 episodes of row 0 each
        trajs = []
        for _ in range(4):
            obs, info = DatasetEnv(str(path)).reset(row_index=0)  # every episode builds its env
            trajs.append(Trajectory(token_ids=[1], action_turn=[-1], sampling_logps=[0.0], rewards=[0.0],
                                    group_id=0, prompt_len=1, observation=obs, replies=["x"], task_info=info))  # fmt: skip
        reward.apply(trajs)
    assert (
        fns.SEEN == [[1, 1, 1, 1]] * 3
    )  # the old code saw [5, 5, 5, 5] at the second step: the cached row grew
