"""The HF engine reuses a turn's KV cache for the next turn of the same episodes
(env.history=full): the same tokens and log-probs as prefilling every turn again."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from rlhf_lightning.envs.guess_number import GuessNumberEnv
from rlhf_lightning.models.build import load_model, load_tokenizer
from rlhf_lightning.models.tiny import ASSETS
from rlhf_lightning.records.sampling import SamplingParams
from rlhf_lightning.rollout.engines.hf import HFEngine
from rlhf_lightning.rollout.episodes.chat import ChatFormatter
from rlhf_lightning.rollout.episodes.harness import RolloutHarness


@pytest.fixture(scope="module")
def chat_model():
    path = str(ASSETS / "tiny_chat")
    return load_model(path, dtype="float32", attn_implementation="eager"), load_tokenizer(path)


def play(model, tok, reuse: bool, temperature: float, seed: int = 0):
    """Guess-the-number episodes (5 turns at most, the conversation kept whole); returns the
    rollout and the turn cache the harness's session used (None without reuse)."""
    engine = HFEngine(
        lambda: model, tok.pad_token_id, [tok.eos_token_id], tokenizer=tok, reuse_turn_cache=reuse
    )
    seen = []
    original = engine.turn_session

    @contextmanager
    def spy():
        with original() as cache:
            seen.append(cache)
            yield cache

    engine.turn_session = spy  # type: ignore[method-assign]
    harness = RolloutHarness(lambda: GuessNumberEnv(max_turns=5), tok, ChatFormatter(tok), max_turns=5)
    torch.manual_seed(seed)
    result = harness.rollout(engine, [1, 2, 3, 4], SamplingParams(8, temperature=temperature), group_size=3)
    assert len(seen) == 1, "one session per rollout"
    return result, seen[0]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_reusing_the_cache_equals_prefilling_every_turn(chat_model, temperature):
    model, tok = chat_model
    fresh, _ = play(model, tok, reuse=False, temperature=temperature)
    reused, cache = play(model, tok, reuse=True, temperature=temperature)
    turns = max(t.num_turns for t in fresh.trajectories)
    assert turns >= 3, "the episodes should run several turns"
    for a, b in zip(fresh.trajectories, reused.trajectories, strict=True):
        assert a.token_ids == b.token_ids and a.action_turn == b.action_turn
        # each turn's log-probs, within float32 noise of a different matmul shape
        for k in range(a.num_turns):
            la = [p for p, t in zip(a.sampling_logps, a.action_turn) if t == k]
            lb = [p for p, t in zip(b.sampling_logps, b.action_turn) if t == k]
            assert lb == pytest.approx(la, abs=2e-5), f"turn {k}"
    # every turn after the first ran on the cache, and only its new tokens were prefilled
    assert cache.reused_calls == turns - 1
    every_turn = sum(sum(t.turn_starts()) for t in fresh.trajectories)  # prompt tokens of each call
    assert cache.prefilled_tokens < 0.5 * every_turn


def test_a_row_that_continues_nothing_runs_from_scratch(chat_model):
    model, tok = chat_model
    engine = HFEngine(lambda: model, tok.pad_token_id, [tok.eos_token_id], tokenizer=tok)
    ids = tok("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False).input_ids
    other = tok("<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    params = SamplingParams(4, temperature=0.0)
    with engine.turn_session() as cache:
        first = engine.generate([ids], params)[0]
        assert cache.reused_calls == 0 and cache.last is not None
        follow = ids + first.token_ids + tok("\nmore", add_special_tokens=False).input_ids
        engine.generate([follow], params)
        assert cache.reused_calls == 1  # continued the first call's row
        engine.generate([other.input_ids], params)
        assert cache.reused_calls == 1  # a new episode: no row of the last call is its prefix
    assert engine.turn_cache is None  # dropped on exit


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_shared_prefix_runs_once_and_samples_as_left_padded_prompts(chat_model, temperature):
    """Prompts that start alike (the instructions of every turn with env.history=last), some
    identical (a group): the shared layout samples what left-padded prompts sample."""
    model, tok = chat_model
    rules = "You are playing a game. " * 6
    texts = [f"{rules}Board {k}: " + ". " * k for k in (1, 4, 4, 9)]
    rows = [
        tok(
            tok.apply_chat_template(
                [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        ).input_ids
        for t in texts
    ]
    from rlhf_lightning.rollout.engines.kv_reuse import prefill_shared

    laid = prefill_shared(model, rows, tok.pad_token_id, "cpu")
    assert laid is not None
    shared_cols = laid[0].shape[1] - max(len(r) for r in rows)
    assert laid[3] < sum(len(r) for r in rows) - 2 * shared_cols  # the prefix ran once
    out = {}
    for share in (False, True):
        engine = HFEngine(lambda: model, tok.pad_token_id, [tok.eos_token_id], share_prefill=share)
        torch.manual_seed(3)
        out[share] = engine.generate(rows, SamplingParams(6, temperature=temperature, n=2))
    for a, b in zip(out[False], out[True], strict=True):
        assert a.token_ids == b.token_ids
        assert b.logprobs == pytest.approx(a.logprobs, abs=2e-5)
