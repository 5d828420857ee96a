"""The HF engine with one LoRA adapter per prompt (``generate(..., adapters=[...])``): a mixed
batch gives each row what its adapter gives alone, in tokens (greedy) and in log-probs."""

from __future__ import annotations

import pytest
import torch

from rlhf_lightning.models.adapters import ACTOR
from rlhf_lightning.models.build import build_policy, load_model
from rlhf_lightning.records.sampling import SamplingParams
from rlhf_lightning.records.trajectory import Trajectory, collate
from rlhf_lightning.rollout.engines.hf import HFEngine
from tests.rollout.test_hf import prompts

MEMBERS = (ACTOR, "member1", "member2")


def members_policy(tiny_path):
    """A LoRA policy with three adapters on one base, each with weights of its own."""
    policy = build_policy(
        load_model(tiny_path, dtype="float32", attn_implementation="eager"), finetune="lora"
    )
    peft = policy.model
    for name in MEMBERS[1:]:
        peft.add_adapter(name, peft.peft_config[ACTOR])
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    peft.set_adapter(ACTOR)
    return policy


@pytest.fixture(scope="module")
def members(tiny_path):
    return members_policy(tiny_path)


def engine_of(policy, tokenizer) -> HFEngine:
    return HFEngine(policy.generation_model, tokenizer.pad_token_id, [tokenizer.eos_token_id])


def alone(policy, tokenizer, name, ps, params):
    policy.model.set_adapter(name)
    try:
        return engine_of(policy, tokenizer).generate(ps, params)
    finally:
        policy.model.set_adapter(ACTOR)


def mixed_order(ps, grouped=False):
    """(prompt, adapter) pairs, each prompt under every adapter: interleaved (PEFT's per-row
    path), or grouped adapter by adapter (a population's rollout: the slices path)."""
    if grouped:
        return [(k, name) for name in MEMBERS for k in range(len(ps))]
    return [(k, name) for k in range(len(ps)) for name in MEMBERS]


@pytest.mark.parametrize("grouped", [False, True], ids=["interleaved", "grouped"])
def test_a_mixed_greedy_batch_gives_each_row_its_adapters_tokens_and_logprobs(
    members, tiny_tokenizer, grouped
):
    ps = prompts(tiny_tokenizer)
    params = SamplingParams(max_new_tokens=8, temperature=0.0, n=2)  # n=2: the shared prefill too
    solo = {name: alone(members, tiny_tokenizer, name, ps, params) for name in MEMBERS}
    order = mixed_order(ps, grouped)
    out = engine_of(members, tiny_tokenizer).generate(
        [ps[k] for k, _ in order], params, [n for _, n in order]
    )
    assert len(out) == 2 * len(order)
    for j, (k, name) in enumerate(order):
        for copy in range(2):
            got, want = out[2 * j + copy], solo[name][2 * k + copy]
            assert got.prompt_index == j and got.token_ids == want.token_ids, (k, name)
            torch.testing.assert_close(
                torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5, rtol=0
            )
    # The adapters differ: the same prompt's greedy log-probs are not alike across members.
    first = [torch.tensor(solo[name][0].logprobs[:1]) for name in MEMBERS]
    assert min((a - b).abs().max().item() for a in first for b in first if a is not b) > 1e-3


@torch.no_grad()
def teacher_forced_gap(policy, tokenizer, ps, order, out, name, temperature, under=None) -> float:
    """Max |engine log-prob - the log-prob under adapter ``under`` (default ``name``) alone| over
    the completions of ``out`` whose prompt (``order[prompt_index]``) is ``name``'s."""
    trajs = []
    for c in out:
        k, owner = order[c.prompt_index]
        if owner == name:
            prompt = ps[k]
            trajs.append(
                Trajectory(
                    prompt + c.token_ids,
                    [-1] * len(prompt) + [0] * len(c.token_ids),
                    [0.0] * len(prompt) + c.logprobs,
                    [0.0],
                    c.prompt_index,
                    len(prompt),
                )
            )
    b = collate(trajs, tokenizer.pad_token_id)
    policy.model.set_adapter(under or name)
    try:
        logp, _ = policy.token_logprobs(b.input_ids, b.attention_mask, b.action_mask, temperature=temperature)
    finally:
        policy.model.set_adapter(ACTOR)
    return (logp - b.sampling_logps)[b.action_mask].abs().max().item()


@pytest.mark.parametrize("grouped", [False, True], ids=["interleaved", "grouped"])
def test_sampled_rows_carry_the_logprobs_of_their_own_adapter(members, tiny_tokenizer, grouped):
    """Sampling draws differ with the batch's make-up, so the check is the log-prob each sampled
    token has under its row's adapter alone (teacher-forced), which the engine must return."""
    torch.manual_seed(0)
    ps = prompts(tiny_tokenizer)
    order = mixed_order(ps, grouped)
    params = SamplingParams(max_new_tokens=6, temperature=0.8, n=2)
    out = engine_of(members, tiny_tokenizer).generate(
        [ps[k] for k, _ in order], params, [n for _, n in order]
    )
    for name in MEMBERS:
        assert teacher_forced_gap(members, tiny_tokenizer, ps, order, out, name, 0.8) < 1e-4, name
    # Under another member's adapter the same tokens have other log-probs: the check can fail.
    assert teacher_forced_gap(members, tiny_tokenizer, ps, order, out, "member1", 0.8, under=ACTOR) > 1e-2


def test_one_adapter_per_prompt_is_required(members, tiny_tokenizer):
    ps = prompts(tiny_tokenizer)
    with pytest.raises(ValueError, match="2 adapters for 3 prompts"):
        engine_of(members, tiny_tokenizer).generate(ps, SamplingParams(max_new_tokens=2), [ACTOR, ACTOR])
