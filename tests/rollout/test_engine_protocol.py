"""The engine Protocol names every method the module, its evaluation, the engine callback and
the population call, and both engines implement all of them (nothing is reached by probing)."""

from __future__ import annotations

import inspect

from rlhf_lightning.rollout.engines.base import AdapterSampler, RolloutEngine, Sampler
from rlhf_lightning.rollout.engines.hf import HFEngine
from rlhf_lightning.rollout.engines.vllm import VLLMEngine

CALLED = {"generate", "bind_rank", "wake", "sleep", "sync_weights", "ensure_synced", "invalidate", "shutdown"}


def protocol_methods(proto: type) -> set[str]:
    return {n for n, v in vars(proto).items() if inspect.isfunction(v) and not n.startswith("_")} | (
        protocol_methods(Sampler) if proto is RolloutEngine else set()
    )


def test_the_protocol_lists_what_the_callers_use():
    assert protocol_methods(RolloutEngine) == CALLED
    assert protocol_methods(Sampler) == {"generate"}  # all the harness needs


def test_both_engines_implement_every_method_with_the_protocols_parameters():
    for cls in (HFEngine, VLLMEngine):
        for name in CALLED:
            ours = inspect.signature(getattr(cls, name))
            theirs = inspect.signature(getattr(RolloutEngine if name != "generate" else AdapterSampler, name))
            assert list(ours.parameters) == list(theirs.parameters), (cls.__name__, name)


def test_per_prompt_adapters_extend_the_samplers_generate_with_a_default():
    """What the harness calls (``Sampler.generate``) still works on an adapter sampler."""
    plain = list(inspect.signature(Sampler.generate).parameters)
    mixed = inspect.signature(AdapterSampler.generate).parameters
    assert list(mixed)[: len(plain)] == plain and mixed["adapters"].default is None


def test_the_hf_engine_is_a_rolloutengine(tiny_model):
    engine = HFEngine(lambda: tiny_model, pad_token_id=0, eos_token_ids=[1])
    assert isinstance(engine, RolloutEngine)
    engine.bind_rank(0, 1, 0)
    engine.ensure_synced(tiny_model, 3)
    engine.invalidate()
    engine.shutdown()  # no-ops: it samples the live module
