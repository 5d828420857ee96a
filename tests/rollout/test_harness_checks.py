"""What an env hands the harness is checked where it is accepted: a reset that is not
(observation, info), chat messages the template cannot render, and success fields
(``correct``/``success``/``solved``) that are not bools fail with the env class, the method and
the field named, not inside the harness or the chat template, and never count as solved."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rlhf_lightning.algorithms.evaluation import episode_success, episode_values
from rlhf_lightning.records.sampling import SamplingParams
from rlhf_lightning.rollout.episodes.harness import ChatFormatter, RolloutHarness
from tests.envs.test_harness import ScriptedEngine


class ScriptedEnv:
    """Returns ``first`` from reset and ``then`` from every step."""

    def __init__(self, first, then=("", 0.0, True, False, {})):
        self.first, self.then = first, then

    def reset(self, seed=None, *, row_index=None, evaluation=False):
        return self.first

    def step(self, action):
        return self.then


def run_one(tokenizer, env, max_turns=1):
    harness = RolloutHarness(lambda: env, tokenizer, ChatFormatter(tokenizer), max_turns=max_turns)
    return harness.rollout(ScriptedEngine([[5, 2]]), [0], SamplingParams(max_new_tokens=2), evaluation=True)


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ({"correct": "False"}, r"ScriptedEnv\.step returned info\['correct'\]='False'; a success field"),
        ({"correct": float("nan")}, r"ScriptedEnv\.step returned info\['correct'\]=nan"),
        ({"solved": 2}, r"ScriptedEnv\.step returned info\['solved'\]=2"),
        ({"success": None}, r"ScriptedEnv\.step returned info\['success'\]=None"),
        ({"correct": "True"}, r"info\['correct'\]='True'.*must be a bool \(or 0/1\)"),
    ],
)
def test_a_success_field_that_is_not_a_bool_names_the_env_and_field(tiny_tokenizer, bad, match):
    env = ScriptedEnv(("q", {}), ("", 0.0, True, False, bad))
    with pytest.raises(TypeError, match=match):
        run_one(tiny_tokenizer, env)


@pytest.mark.parametrize(
    ("value", "solved"),
    [
        (True, 1.0),
        (False, 0.0),
        (np.bool_(True), 1.0),
        (np.bool_(False), 0.0),
        (torch.tensor(True), 1.0),
        (torch.tensor(False), 0.0),
        (1, 1.0),
        (0, 0.0),
        (1.0, 1.0),
        (0.0, 0.0),
        (np.int64(1), 1.0),
    ],
)
def test_bools_and_exact_zero_or_one_are_success_values(tiny_tokenizer, value, solved):
    env = ScriptedEnv(("q", {}), ("", 0.0, True, False, {"correct": value}))
    result = run_one(tiny_tokenizer, env)
    assert episode_values(result, 1)["accuracy"].tolist() == [solved]


@pytest.mark.parametrize("value", ["False", float("nan"), 2, -1, None, "0", np.float64("nan")])
def test_evaluation_never_counts_a_non_bool_success_field_as_solved(value):
    """The accuracy (and a population's fitness, which uses the same function) of an episode
    scored 0 whose info says correct="False" was 1.0: ``bool("False")`` is True."""
    episode = SimpleNamespace(infos=[{"correct": value}], rewards=[0.0])
    with pytest.raises(TypeError, match=r"info\['correct'\]=.*must be a bool \(or 0/1\)"):
        episode_success(episode)


@pytest.mark.parametrize(
    ("first", "match"),
    [
        (3, r"ScriptedEnv\.reset must return \(observation, info\), got 3"),
        (("q",), r"ScriptedEnv\.reset must return \(observation, info\)"),
        ((7, {}), r"ScriptedEnv\.reset returned observation of type int"),
        (("q", 5), r"ScriptedEnv\.reset returned info of type int"),
        (
            ([{"role": "robot"}], {}),
            r"ScriptedEnv\.reset returned message 0 with role='robot'; expected one of",
        ),
        (([{"role": "user"}], {}), r"ScriptedEnv\.reset returned message 0 \(user\) with content=None"),
        ((["hi"], {}), r"ScriptedEnv\.reset returned message 0 of type str"),
    ],
)
def test_a_bad_reset_names_the_env_and_what_is_wrong(tiny_tokenizer, first, match):
    with pytest.raises(TypeError, match=match):
        run_one(tiny_tokenizer, ScriptedEnv(first))


def test_bad_messages_from_step_name_the_env_before_the_template_sees_them(tiny_tokenizer):
    then = ([{"role": "narrator"}], 0.0, False, False, {})
    with pytest.raises(TypeError, match=r"ScriptedEnv\.step returned message 0 with role='narrator'"):
        run_one(tiny_tokenizer, ScriptedEnv(("q", {}), then), max_turns=2)


def test_well_formed_messages_and_none_info_are_accepted(tiny_tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q"}]
    result = run_one(tiny_tokenizer, ScriptedEnv((messages, None)))
    assert result.trajectories[0].task_info == {}
    assert result.trajectories[0].observation == messages
