from __future__ import annotations

import pytest
import torch

from rlhf_lightning.models.build import build_policy
from rlhf_lightning.records.sampling import SamplingParams
from rlhf_lightning.records.trajectory import Trajectory, collate
from rlhf_lightning.rollout.engines.hf import HFEngine


def prompts(tokenizer, n=3):
    qs = [
        "What is 10 plus 20?",
        "Anna has 55 shells and gets 12 more. How many shells does Anna have now?",
        "What is 90 minus 9?",
    ]
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        for q in qs[:n]
    ]
    return [tokenizer(t, add_special_tokens=False).input_ids for t in texts]


def test_sampled_logprobs_match_trainer_logprobs(tiny_model, tiny_tokenizer):
    """Left-padded generation and right-padded training must see the same positions."""
    torch.manual_seed(0)
    policy = build_policy(tiny_model, finetune="full")
    engine = HFEngine(policy.generation_model, tiny_tokenizer.pad_token_id, [tiny_tokenizer.eos_token_id])
    ps = [list(p) for p in prompts(tiny_tokenizer)]
    params = SamplingParams(max_new_tokens=6, temperature=0.8, n=4)
    comps = engine.generate(ps, params)
    assert len(comps) == 12 and [c.prompt_index for c in comps] == [0] * 4 + [1] * 4 + [2] * 4
    trajs = [
        Trajectory(
            token_ids=ps[c.prompt_index] + c.token_ids,
            action_turn=[-1] * len(ps[c.prompt_index]) + [0] * len(c.token_ids),
            sampling_logps=[0.0] * len(ps[c.prompt_index]) + c.logprobs,
            rewards=[0.0],
            group_id=c.prompt_index,
            prompt_len=len(ps[c.prompt_index]),
        )
        for c in comps
    ]
    batch = collate(trajs, tiny_tokenizer.pad_token_id)
    logp, _ = policy.token_logprobs(batch.input_ids, batch.attention_mask, batch.action_mask, temperature=0.8)
    torch.testing.assert_close(logp, batch.sampling_logps, rtol=0, atol=1e-4)


def test_stop_tokens_and_finish_reasons(tiny_model, tiny_tokenizer):
    policy = build_policy(tiny_model, finetune="full")
    eos = tiny_tokenizer.eos_token_id
    engine = HFEngine(policy.generation_model, tiny_tokenizer.pad_token_id, [eos], max_batch_size=2)
    comps = engine.generate(
        [list(p) for p in prompts(tiny_tokenizer)], SamplingParams(max_new_tokens=8, temperature=0.0)
    )
    for c in comps:
        assert len(c.token_ids) == len(c.logprobs) >= 1
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == eos and eos not in c.token_ids[:-1]
        else:
            assert len(c.token_ids) == 8 and eos not in c.token_ids
    short = engine.generate(
        [list(p) for p in prompts(tiny_tokenizer)], SamplingParams(max_new_tokens=1, temperature=1.0)
    )
    assert all(len(c.token_ids) == 1 for c in short)
    assert all(c.finish_reason == ("stop" if c.token_ids == [eos] else "length") for c in short)


def test_greedy_is_deterministic(tiny_model, tiny_tokenizer):
    engine = HFEngine(lambda: tiny_model, tiny_tokenizer.pad_token_id, [tiny_tokenizer.eos_token_id])
    ps = [list(p) for p in prompts(tiny_tokenizer)]
    a = engine.generate(ps, SamplingParams(max_new_tokens=6, temperature=0.0))
    b = engine.generate(ps, SamplingParams(max_new_tokens=6, temperature=0.0))
    assert [c.token_ids for c in a] == [c.token_ids for c in b]


@pytest.mark.parametrize("processed", [False, True], ids=["plain", "penalty_min_p_stop"])
def test_shared_prefill_gives_the_same_samples(tiny_model, tiny_tokenizer, processed):
    ps = [list(p) for p in prompts(tiny_tokenizer)]
    rows = [ps[0], ps[1], ps[0], ps[2], ps[1], ps[0]]  # repeated prompts, any order
    extra = {"repetition_penalty": 1.4, "min_p": 0.05, "top_k": 20, "stop": ("3",)} if processed else {}
    outs = []
    for share in (True, False):
        engine = HFEngine(
            lambda: tiny_model,
            tiny_tokenizer.pad_token_id,
            [tiny_tokenizer.eos_token_id],
            share_prefill=share,
            tokenizer=tiny_tokenizer,
        )
        torch.manual_seed(3)
        outs.append(engine.generate(rows, SamplingParams(max_new_tokens=6, temperature=1.0, **extra)))
    assert [c.token_ids for c in outs[0]] == [c.token_ids for c in outs[1]]
    for a, b in zip(outs[0], outs[1]):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-5)
    if processed:  # some rows ended on the stop string, before their eos
        eos = tiny_tokenizer.eos_token_id
        assert any(c.finish_reason == "stop" and c.token_ids[-1] != eos for c in outs[0])
