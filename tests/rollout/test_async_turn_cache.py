"""The async producer reuses the KV cache across the turns of an episode as a synchronous rollout
does (``env.history=full``, :mod:`rlhf_lightning.rollout.engines.kv_reuse`): lockstep async
(``rollout.max_staleness=0``) on a multi-turn env is bitwise the synchronous run, and a turn
that runs on newer weights than the turn before (partial rollouts) never reads the older
weights' cache."""

from __future__ import annotations

import contextlib

import pytest
import torch

from rlhf_lightning.envs.guess_number import GuessNumberEnv
from rlhf_lightning.models.build import load_model, load_tokenizer
from rlhf_lightning.models.tiny import ASSETS
from rlhf_lightning.records.sampling import SamplingParams
from rlhf_lightning.rollout.asynchronous.plan import VersionedSampler, planned
from rlhf_lightning.rollout.engines.hf import HFEngine
from rlhf_lightning.rollout.engines.kv_reuse import TurnCache
from rlhf_lightning.rollout.episodes.chat import ChatFormatter
from rlhf_lightning.rollout.episodes.harness import RolloutHarness
from tests.conftest import FAST, compose_config, fit_steps

MULTI_TURN = [*FAST, "num_threads=1", "env=guess_number", "env.max_turns=3", "env.history=full"]


def fit_watched(overrides: list[str], tmp_path, steps: int) -> tuple:
    """Fit ``steps`` steps of ``overrides``: (module, the sampling log-probs and generated tokens of
    every training rollout, in order)."""
    seen: list = []

    def hook(module):
        original = module.source.collect

        def spy(rows_, sampling, group_size):
            out = original(rows_, sampling, group_size)
            result = out[0]
            trajs = result.trajectories
            seen.append((result.batch.sampling_logps.clone(), [(t.token_ids, t.num_turns) for t in trajs]))
            return out

        module.source.collect = spy

    cfg = compose_config(overrides, output_dir=tmp_path / "run")
    module, _ = fit_steps(cfg, tmp_path, steps=steps, module_hook=hook)
    return module, seen


@pytest.mark.slow
def test_lockstep_async_on_a_multi_turn_env_is_bitwise_the_sync_run(tmp_path, monkeypatch):
    """guess_number with history=full: the sync run samples turns 2.. on the last turn's KV cache;
    the producer must too, else its log-probs differ by ~1e-6 and the trained weights drift."""
    reused: list[int] = []
    session = HFEngine.turn_session

    def counted(self):  # the calls that ran on the last turn's cache, in either process's engine
        with session(self) as cache:
            yield cache
            if cache is not None:
                reused.append(cache.reused_calls)

    monkeypatch.setattr(HFEngine, "turn_session", contextlib.contextmanager(counted))
    sync, sync_seen = fit_watched(MULTI_TURN, tmp_path / "sync", steps=3)
    assert sum(reused) > 0  # the sync run reused a turn's cache (else this test proves nothing)
    lock, lock_seen = fit_watched(
        [*MULTI_TURN, "rollout.mode=async", "rollout.max_staleness=0"], tmp_path / "async", steps=3
    )
    assert len(sync_seen) == len(lock_seen) == 3
    assert any(turns > 1 for _, episodes in sync_seen for _, turns in episodes)
    for (s_logps, s_tokens), (a_logps, a_tokens) in zip(sync_seen, lock_seen):
        assert a_tokens == s_tokens
        assert torch.equal(a_logps, s_logps)
    sync_w, lock_w = dict(sync.policy.named_parameters()), dict(lock.policy.named_parameters())
    assert sync_w.keys() == lock_w.keys()
    for name, value in sync_w.items():
        assert torch.equal(lock_w[name], value), name


class SessionEngine:
    """An engine with a turn session: each call notes whether the last call's cache was still
    there, then leaves one of its own (as ``HFEngine`` records its cache)."""

    def __init__(self) -> None:
        self.cache: TurnCache | None = None
        self.found: list[bool] = []

    @contextlib.contextmanager
    def turn_session(self):
        self.cache = TurnCache()
        try:
            yield self.cache
        finally:
            self.cache = None

    def generate(self, prompt_token_ids, params):
        assert self.cache is not None
        self.found.append(self.cache.last is not None)
        self.cache.last = object()  # stands for this call's cache
        return []


def test_the_sampler_opens_the_engines_turn_session_and_drops_the_cache_when_the_version_changes():
    engine = SessionEngine()
    loaded: list[int] = []
    sampler = VersionedSampler(engine, loaded.append, planned([1, 1, 2, 2]))
    with sampler.turn_session() as turns:
        assert turns is engine.cache is not None  # the engine's own session
        for k in range(4):
            sampler.generate([[k]], SamplingParams(max_new_tokens=1))
    # call 0: nothing yet; call 1 (same version): reuses; call 2 (version 2): from scratch; call 3: reuses
    assert engine.found == [False, True, False, True] and loaded == [1, 1, 2, 2]
    assert sampler.turns is None and engine.cache is None  # closed with the session


def test_the_sampler_of_an_engine_without_a_turn_session_yields_none():
    class Plain:
        def generate(self, prompt_token_ids, params):
            return []

    sampler = VersionedSampler(Plain(), lambda v: None, planned([0, 1]))
    with sampler.turn_session() as turns:
        assert turns is None
        sampler.generate([[1]], SamplingParams(max_new_tokens=1))
        sampler.generate([[1, 2]], SamplingParams(max_new_tokens=1))
    assert sampler.used == [0, 1]


def test_a_partial_rollouts_turns_on_newer_weights_equal_a_rollout_without_the_cache():
    """Turn 0 on version 0, later turns on version 1 (a partial rollout): turn 1 must not continue
    version 0's cache. Every log-prob equals prefilling every turn again, within float32 noise."""
    path = str(ASSETS / "tiny_chat")
    model = load_model(path, dtype="float32", attn_implementation="eager")
    tok = load_tokenizer(path)
    params = dict(model.named_parameters())
    base = {k: v.detach().clone() for k, v in params.items()}
    g = torch.Generator().manual_seed(0)
    delta = {k: 0.05 * torch.randn(v.shape, generator=g) for k, v in base.items()}

    def load(version: int) -> None:
        with torch.no_grad():
            for k, p in params.items():
                p.copy_(base[k] + version * delta[k])

    def play(reuse: bool):
        engine = HFEngine(
            lambda: model, tok.pad_token_id, [tok.eos_token_id], tokenizer=tok, reuse_turn_cache=reuse
        )
        sampler = VersionedSampler(engine, load, planned([0, 1]))
        caches: list = []
        original = sampler.turn_session

        @contextlib.contextmanager
        def spy():
            with original() as cache:
                caches.append(cache)
                yield cache

        sampler.turn_session = spy  # type: ignore[method-assign]
        harness = RolloutHarness(lambda: GuessNumberEnv(max_turns=4), tok, ChatFormatter(tok), max_turns=4)
        torch.manual_seed(0)
        out = harness.rollout(sampler, [1, 2, 3], SamplingParams(8, temperature=0.0), group_size=2)
        return out, caches[0], sampler.used

    fresh, _, used = play(reuse=False)
    reused, cache, _ = play(reuse=True)
    assert used[:2] == [0, 1] and len(used) >= 3  # a turn on each version, and one more on version 1
    for a, b in zip(fresh.trajectories, reused.trajectories, strict=True):
        assert a.token_ids == b.token_ids
        assert b.sampling_logps == pytest.approx(a.sampling_logps, abs=2e-5)
    assert cache.reused_calls == len(used) - 2  # turn 1 from scratch (new weights), later turns reuse
