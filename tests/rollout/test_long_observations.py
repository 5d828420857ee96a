"""An observation that cannot fit ends the episode (truncated) before it is rendered or tokenized:
a multi-megabyte observation used to be tokenized in full (seconds) only to be found too long."""

from __future__ import annotations

import pytest

from rlhf_lightning.records.sampling import SamplingParams
from rlhf_lightning.rollout.episodes.harness import ChatFormatter, RolloutHarness
from tests.envs.test_harness import ScriptedEngine


class TalkativeEnv:
    """Two turns: the reset's short question, then ``observation`` (not terminal)."""

    def __init__(self, observation) -> None:
        self.observation = observation

    def reset(self, seed=None, *, row_index=None, evaluation=False):
        return "q", {}

    def step(self, action):
        return self.observation, 0.0, False, False, {}


class CountingFormatter(ChatFormatter):
    """Records the longest text it was asked to render into ids."""

    longest = 0

    def observation_text(self, observation):
        text = super().observation_text(observation)
        self.longest = max(self.longest, len(text))
        return text

    def prompt_text(self, observation):
        text = super().prompt_text(observation)
        self.longest = max(self.longest, len(text))
        return text


def rollout(tokenizer, observation, history: str, max_model_len: int):
    formatter = CountingFormatter(tokenizer)
    harness = RolloutHarness(
        lambda: TalkativeEnv(observation), tokenizer, formatter, max_turns=2, max_model_len=max_model_len,
        history=history,
    )  # fmt: skip
    result = harness.rollout(ScriptedEngine([[5, 2]]), [0], SamplingParams(max_new_tokens=2), evaluation=True)
    return result.trajectories[0], formatter


@pytest.mark.parametrize("history", ["full", "last", "last_k"])
@pytest.mark.parametrize("shape", ["text", "messages"])
def test_an_observation_that_cannot_fit_is_never_rendered(tiny_tokenizer, history, shape):
    huge = "word " * 200_000  # 1 MB: 200,000+ tokens against a 128-token model length
    observation = huge if shape == "text" else [{"role": "user", "content": huge}]
    traj, formatter = rollout(tiny_tokenizer, observation, history, max_model_len=128)
    assert traj.truncated and traj.num_turns == 1
    assert formatter.longest < 1000  # only the first prompt was rendered


@pytest.mark.parametrize("history", ["full", "last"])
def test_an_observation_that_fits_is_the_next_turn(tiny_tokenizer, history):
    traj, _ = rollout(tiny_tokenizer, "twelve and thirty", history, max_model_len=128)
    assert traj.num_turns == 2


@pytest.mark.parametrize(
    "text",
    ["word " * 500, "é" * 700, "12345678901234567890" * 40, "<|im_end|>" * 60, " \n\t" * 300, "汉字" * 300],
)
def test_the_bound_never_exceeds_the_tokens(tiny_tokenizer, text):
    formatter = ChatFormatter(tiny_tokenizer)
    assert formatter.fewest_tokens(text) <= len(tiny_tokenizer(text, add_special_tokens=False).input_ids)
