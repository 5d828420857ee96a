"""env=agent's episode driver with the tiny tool model on the HF engine: agents written with the
``openai`` client play in worker processes; their recorded calls are the trajectories, token for
token; hung, crashed and silent agents cost their episode only."""

from __future__ import annotations

import json
import time

import pytest

from rlhf_lightning.config import ASSETS
from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.envs.agent import AgentEnv
from rlhf_lightning.models.build import load_model, load_tokenizer
from rlhf_lightning.records.sampling import SamplingParams
from rlhf_lightning.rollout.agents.runner import AgentEpisodeError, AgentRunner
from rlhf_lightning.rollout.engines.hf import HFEngine
from rlhf_lightning.rollout.episodes.chat import ChatFormatter
from tests.runtime.test_workers import alive

AGENTS = "tests.rollout.agents.calc_agent"
PARAMS = SamplingParams(max_new_tokens=24)


class CountingEngine(HFEngine):
    """The HF engine, keeping every call's completions."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen = []

    def generate(self, prompts, params):
        out = super().generate(prompts, params)
        self.seen.append((prompts, out))
        return out


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    d = tmp_path_factory.mktemp("tasks")
    with open(d / "tasks.jsonl", "w") as f:
        for i in range(40):
            f.write(json.dumps({"question": f"What is {i} + {2 * i}?", "answer": str(3 * i)}) + "\n")
    tok = load_tokenizer(str(ASSETS / "tiny_tools"))
    model = load_model(str(ASSETS / "tiny_tools"), dtype="float32", attn_implementation="eager")
    return tok, model, {"path": str(d / "tasks.jsonl"), "scorer": "integer"}


def runner_for(parts, agent, **kw):
    tok, model, data = parts
    env = AgentEnv(f"{AGENTS}:{agent}", data)
    engine = CountingEngine(lambda: model, tok.pad_token_id, [tok.eos_token_id])
    kw = {"concurrency": 4, "step_timeout_s": 60, "on_reward_error": "zero", **kw}
    return AgentRunner(env, tok, ChatFormatter(tok), max_model_len=1024, **kw), engine


def test_recorded_calls_are_what_the_engine_generated_and_the_row_is_their_concatenation(parts):
    runner, engine = runner_for(parts, "solve")
    try:
        result = runner.rollout(engine, [0, 1], PARAMS, group_size=2, version=lambda: 5)
        plain = runner.rollout(engine, [2], PARAMS, group_size=1)  # no version: the current weights
    finally:
        runner.shutdown()
    assert plain.trajectories[0].turn_versions == []
    generated = {tuple(c.token_ids) for _, out in engine.seen for c in out}
    assert len(result.trajectories) == 4 and result.metrics["env/reward_errors"] == 0
    for t in result.trajectories:
        assert t.num_turns == 2 and t.turn_versions == [5, 5]
        pieces = [[tok for tok, turn in zip(t.token_ids, t.action_turn) if turn == k] for k in range(2)]
        assert all(tuple(p) in generated for p in pieces)  # byte for byte the engine's ids
        assert t.segment_starts == [0]  # the second prompt extends the first call: one sequence
        # Two episodes can sample the same second reply, so match against every prompt that produced it.
        second_prompts = [
            list(p)
            for prompts, out in engine.seen
            for p, c in zip(prompts, out)
            if list(c.token_ids) == pieces[1]
        ]
        assert second_prompts and t.token_ids in [p + pieces[1] for p in second_prompts]
    assert result.metrics["agent/extended_share"] == 1.0
    assert result.batch.rewards.shape == (4, 2) and result.batch.rewards[:, 0].abs().sum() == 0


def test_an_agent_that_drops_its_history_gets_restarted_sequences_still_token_exact(parts):
    runner, engine = runner_for(parts, "forgetful")
    try:
        result = runner.rollout(engine, [3], PARAMS, group_size=2)
    finally:
        runner.shutdown()
    prompts = {tuple(c.token_ids): list(p) for ps, out in engine.seen for p, c in zip(ps, out)}
    for t in result.trajectories:
        assert len(t.segment_starts) == 2 and t.rewards == [0.0, 0.5]
        for k, (start, n) in enumerate(zip(t.segment_starts, t.segment_lengths())):
            seq = t.token_ids[start : start + n]
            gen = [tok for tok, turn in zip(seq, t.action_turn[start : start + n]) if turn == k]
            assert seq == prompts[tuple(gen)] + gen
    assert result.metrics["agent/restarted_share"] == 1.0
    assert result.batch.position_ids is not None


def test_rounds_batching_repeats_exactly_and_serves_each_round_in_one_engine_call(parts):
    """batching=rounds: 8 two-call episodes on 8 workers are two engine calls of 8 prompts, in the
    order the episodes were opened; the same seed gives the same trajectories, token for token
    (batching=window gives batches as the calls happen to arrive, e.g. [4, 5, 4, 3])."""
    import torch

    runs = []
    for _ in range(2):
        runner, engine = runner_for(parts, "solve", concurrency=8)
        torch.manual_seed(7)
        try:
            result = runner.rollout(engine, [0, 1, 2, 3], SamplingParams(max_new_tokens=24), group_size=2)
        finally:
            runner.shutdown()
        assert result.metrics["env/reward_errors"] == 0
        assert [len(prompts) for prompts, _ in engine.seen] == [8, 8]
        runs.append([(t.token_ids, t.rewards) for t in result.trajectories])
    assert runs[0] == runs[1]
    assert len({tuple(ids) for ids, _ in runs[0]}) > 4  # sampled: episodes differ, yet repeat exactly


def test_streamed_calls_train_like_whole_ones(parts):
    runner, engine = runner_for(parts, "solve_streaming")
    try:
        result = runner.rollout(engine, [2], PARAMS, group_size=2)
    finally:
        runner.shutdown()
    assert all(t.num_turns == 2 and t.rewards == [0.0, 1.0] for t in result.trajectories)


def test_a_hung_agent_is_killed_at_its_deadline_and_a_crashed_or_silent_one_scored_zero(parts):
    for agent, why in (("hangs", "deadline"), ("crashes", "the agent's own bug"), ("silent", "never called")):
        runner, engine = runner_for(parts, agent, step_timeout_s=4.0, concurrency=2)
        start = time.monotonic()
        try:
            result = runner.rollout(engine, [0], PARAMS, group_size=2)
            pids = runner.pool.pids() if runner.pool else []
        finally:
            runner.shutdown()
        assert time.monotonic() - start < 30
        assert result.metrics["env/reward_errors"] == 2 and result.batch.returns.tolist() == [0.0, 0.0]
        assert not any(alive(p) for p in pids)
        if agent == "silent":
            assert not result.batch.action_mask.any()  # nothing generated: nothing to train
        runner, engine = runner_for(parts, agent, step_timeout_s=4.0, on_reward_error="raise")
        with pytest.raises(AgentEpisodeError, match=why):
            try:
                runner.rollout(engine, [0], PARAMS, group_size=1)
            finally:
                runner.shutdown()


@pytest.mark.parametrize(
    "agent, why",
    [
        ("nowhere:solve", "importable"),
        (f"{AGENTS}:missing", "importable"),
        (f"{AGENTS}:not_async", "an async function"),
    ],
)
def test_a_bad_agent_path_is_refused_naming_the_field(parts, agent, why):
    with pytest.raises(ConfigError, match=rf"env\.kwargs\.agent.*{why}"):
        AgentEnv(agent, parts[2])
