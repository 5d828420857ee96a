from __future__ import annotations

import numpy as np
import pytest
import torch

from rlhf_lightning.envs.arithmetic import ArithmeticEnv
from rlhf_lightning.records.sampling import Completion, SamplingParams
from rlhf_lightning.rollout.episodes.harness import ChatFormatter, RolloutHarness


class ScriptedEngine:
    """Returns fixed token ids per call, so the expected trajectory is known exactly."""

    def __init__(self, replies: list[list[int]], finish: str = "stop") -> None:
        self.replies, self.finish, self.calls = replies, finish, []

    def generate(self, prompt_token_ids, params):
        self.calls.append([list(p) for p in prompt_token_ids])
        out = []
        for i, _ in enumerate(prompt_token_ids):
            ids = self.replies[i % len(self.replies)]
            out.append(Completion(list(ids), [-0.5] * len(ids), self.finish, i))
        return out

    def sleep(self):
        pass

    def wake(self):
        pass

    def sync_weights(self, model):
        pass


def test_single_turn_batch_is_token_exact(tiny_tokenizer):
    tok = tiny_tokenizer
    answer_ids = tok("42", add_special_tokens=False).input_ids + [tok.eos_token_id]
    other_ids = tok("7", add_special_tokens=False).input_ids + [tok.eos_token_id]
    engine = ScriptedEngine([answer_ids, other_ids])
    harness = RolloutHarness(ArithmeticEnv, tok, ChatFormatter(tok), max_turns=1, max_model_len=256)
    result = harness.rollout(engine, [0, 5], SamplingParams(max_new_tokens=4), group_size=2)
    b = result.batch
    assert b.input_ids.shape[0] == 4 and b.group_ids.tolist() == [0, 0, 1, 1]
    for i in range(len(result.trajectories)):
        prompt = ChatFormatter(tok).prompt_ids(ArithmeticEnv().reset(row_index=[0, 5][i // 2])[0])
        reply = [answer_ids, other_ids][i % 2]
        n = len(prompt) + len(reply)
        assert b.input_ids[i, :n].tolist() == prompt + reply
        assert b.attention_mask[i].sum().item() == n
        # action_mask[t] marks token t+1: exactly the reply positions.
        expected = torch.zeros(b.action_mask.shape[1], dtype=torch.bool)
        expected[len(prompt) - 1 : n - 1] = True
        assert torch.equal(b.action_mask[i], expected)
        assert b.turn_ids[i][expected].eq(0).all() and b.turn_ids[i][~expected].eq(-1).all()
        assert torch.allclose(b.sampling_logps[i][expected], torch.tensor(-0.5))
    assert b.rewards.shape == (4, 1)


class BadEnv:
    def __init__(self, bad):
        self.bad = bad

    def reset(self, seed=None, *, row_index=None, evaluation=False):
        return "q", {}

    def step(self, action):
        return self.bad


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ((None, 1.0, True, False, {}), "BadEnv.step returned observation of type NoneType"),
        (("", float("nan"), True, False, {}), "BadEnv.step returned reward=nan"),
        (("", "1", True, False, {}), "BadEnv.step returned reward='1'"),
        (("", np.float32("inf"), True, False, {}), r"BadEnv.step returned reward=np.float32\(inf\)"),
        (("", np.bool_(True), True, False, {}), r"BadEnv.step returned reward=np.True_"),
        (("", torch.tensor([1.0]), True, False, {}), r"BadEnv.step returned reward=tensor\(\[1\.\]\)"),
        (("", 1.0, 1, False, {}), "BadEnv.step returned terminated=1"),
        (("", 1.0, True, False), "BadEnv.step must return"),
    ],
)
def test_env_returning_wrong_types_is_named(tiny_tokenizer, bad, match):
    harness = RolloutHarness(lambda: BadEnv(bad), tiny_tokenizer, ChatFormatter(tiny_tokenizer))
    with pytest.raises(TypeError, match=match):
        harness.rollout(ScriptedEngine([[5, 2]]), [0], SamplingParams(max_new_tokens=2))


@pytest.mark.parametrize(
    "reward", [np.float32(0.5), np.float64(0.5), np.int64(1), np.array(0.5), torch.tensor(0.5), 0.5]
)
def test_numpy_and_0d_tensor_rewards_are_numbers(tiny_tokenizer, reward):
    harness = RolloutHarness(
        lambda: BadEnv(("", reward, True, False, {})), tiny_tokenizer, ChatFormatter(tiny_tokenizer)
    )
    result = harness.rollout(ScriptedEngine([[5, 2]]), [0], SamplingParams(max_new_tokens=2))
    assert result.batch.rewards.tolist() == [[float(reward)]]
    assert type(result.trajectories[0].rewards[0]) is float


class AdapterEngine(ScriptedEngine):
    """Records the adapter each prompt was sampled under."""

    def generate(self, prompt_token_ids, params, adapters=None):
        self.adapters = list(adapters) if adapters is not None else None
        return super().generate(prompt_token_ids, params)


def test_per_row_adapters_and_group_sizes(tiny_tokenizer):
    """Row i's group_sizes[i] episodes are sampled under adapters[i] and say so; group ids count
    groups in row order."""
    tok = tiny_tokenizer
    engine = AdapterEngine([tok("42", add_special_tokens=False).input_ids + [tok.eos_token_id]])
    harness = RolloutHarness(ArithmeticEnv, tok, ChatFormatter(tok), max_turns=1, max_model_len=256)
    result = harness.rollout(
        engine,
        [0, 5, 0],
        SamplingParams(max_new_tokens=4),
        adapters=["m0", "m0", "m1"],
        group_sizes=[2, 2, 3],
    )
    assert engine.adapters == ["m0"] * 4 + ["m1"] * 3
    assert [t.adapter for t in result.trajectories] == engine.adapters
    assert result.batch.group_ids.tolist() == [0, 0, 1, 1, 2, 2, 2]
    with pytest.raises(ValueError, match="2 group_sizes for 3 rows"):
        harness.rollout(engine, [0, 5, 0], SamplingParams(max_new_tokens=4), group_sizes=[2, 2])
