"""The HF engine samples exactly what ``SamplingParams`` says (nothing from the checkpoint's
``generation_config``), returns processed log-probs, and ends completions on stop strings."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from rlhf_lightning.models.build import build_policy, load_model
from rlhf_lightning.records.sampling import SamplingParams
from rlhf_lightning.rollout.engines.hf import HFEngine
from tests.rollout.test_hf import prompts


def engine_for(model, tok, **kwargs):
    return HFEngine(lambda: model, tok.pad_token_id, [tok.eos_token_id], **kwargs)


@pytest.mark.parametrize("finetune", ["full", "lora"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_checkpoint_generation_config_does_not_leak(tiny_path, tiny_tokenizer, finetune, temperature):
    """Qwen2.5-Instruct ships a generation_config with a repetition penalty, top-k, ...: a model
    carrying such a config must sample exactly as one with a default config."""
    polluted = GenerationConfig(
        do_sample=True,
        temperature=0.5,
        top_k=3,
        repetition_penalty=1.3,
        no_repeat_ngram_size=2,
        min_new_tokens=4,
        suppress_tokens=[7, 9],
        eos_token_id=tiny_tokenizer.eos_token_id,
        pad_token_id=tiny_tokenizer.pad_token_id,
    )
    ps = [list(p) for p in prompts(tiny_tokenizer)]
    params = SamplingParams(max_new_tokens=8, temperature=temperature, n=3)
    outs = []
    for config in (None, polluted):
        torch.manual_seed(0)
        model = load_model(tiny_path, dtype="float32", attn_implementation="eager")
        policy = build_policy(model, finetune=finetune)
        if config is not None:
            model.generation_config = config
        before = model.generation_config
        torch.manual_seed(1)
        outs.append(engine_for(policy.generation_model(), tiny_tokenizer).generate(ps, params))
        assert model.generation_config is before  # restored after the call
    clean, dirty = outs
    assert [c.token_ids for c in dirty] == [c.token_ids for c in clean]
    assert [c.finish_reason for c in dirty] == [c.finish_reason for c in clean]
    for a, b in zip(clean, dirty):
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), rtol=0, atol=1e-6)


def processed_reference(model, prompt, completion, params):
    """Independent float64 processed log-probs: vLLM's order (repetition penalty over prompt and
    completion so far, temperature, min-p, top-k, top-p), from one plain forward of the row."""
    seq = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=seq).logits[0].double()  # (L, V)
    out = []
    for t, token in enumerate(completion):
        z = logits[len(prompt) + t - 1].clone()
        seen = torch.zeros_like(z, dtype=torch.bool)
        seen[seq[0, : len(prompt) + t]] = True
        p = params.repetition_penalty
        z = torch.where(seen, torch.where(z > 0, z / p, z * p), z)
        if not params.greedy:
            z = z / params.temperature
            probs = z.softmax(-1)
            z[probs < params.min_p * probs.max()] = -torch.inf
            if params.top_k:
                z[z < z.topk(params.top_k).values[-1]] = -torch.inf
            if params.top_p < 1.0:
                sorted_z, order = z.sort()  # ascending
                drop = sorted_z.softmax(-1).cumsum(-1) <= 1 - params.top_p
                drop[-1] = False
                z[order[drop]] = -torch.inf
        out.append(z.log_softmax(-1)[token].item())
    return out


@pytest.mark.parametrize("mode", ["sampled", "greedy"])
def test_penalty_and_min_p_shape_sampling_and_logprobs(tiny_model, tiny_tokenizer, mode):
    """Left-padded prompts of different lengths; log-probs are those of the processed distribution."""
    if mode == "sampled":
        params = SamplingParams(
            10, temperature=0.7, top_k=30, top_p=0.95, n=3, repetition_penalty=1.5, min_p=0.1
        )
    else:
        params = SamplingParams(10, temperature=0.0, repetition_penalty=1.5)
    ps = [list(p) for p in prompts(tiny_tokenizer)]
    engine = engine_for(tiny_model, tiny_tokenizer)
    torch.manual_seed(0)
    comps = engine.generate(ps, params)
    plain = SamplingParams(params.max_new_tokens, temperature=params.temperature, n=params.n)
    torch.manual_seed(0)
    unpenalized = engine.generate(ps, plain)
    assert [c.token_ids for c in comps] != [c.token_ids for c in unpenalized]  # it changes sampling
    gap_to_plain = 0.0
    for c in comps:
        prompt = ps[c.prompt_index]
        want = processed_reference(tiny_model, prompt, c.token_ids, params)
        torch.testing.assert_close(
            torch.tensor(c.logprobs), torch.tensor(want, dtype=torch.float32), rtol=0, atol=1e-5
        )
        raw = processed_reference(tiny_model, prompt, c.token_ids, plain)
        gap_to_plain = max(gap_to_plain, max(abs(a - b) for a, b in zip(c.logprobs, raw)))
    assert gap_to_plain > 1e-2  # the reference is sensitive to the penalty and the filters


def test_stop_strings_end_each_completion_on_its_own_stop(tiny_model, tiny_tokenizer):
    tok = tiny_tokenizer
    ps = [list(p) for p in prompts(tok)]
    params = SamplingParams(max_new_tokens=8, temperature=1.0, n=4)
    torch.manual_seed(5)
    free = engine_for(tiny_model, tok, tokenizer=tok).generate(ps, params)
    # A stop string that some completions contain (not at their first token) and others not.
    stop = tok.decode(free[0].token_ids[1:2])
    torch.manual_seed(5)
    cut = engine_for(tiny_model, tok, tokenizer=tok).generate(
        ps, SamplingParams(8, temperature=1.0, n=4, stop=(stop,))
    )
    n_stopped = 0
    for f, c in zip(free, cut):
        ends = [
            k
            for k in range(1, len(f.token_ids) + 1)
            if stop in tok.decode(f.token_ids[:k], skip_special_tokens=True)
        ]
        if ends:
            n_stopped += 1
            assert c.token_ids == f.token_ids[: ends[0]] and c.finish_reason == "stop"
            assert c.logprobs == pytest.approx(f.logprobs[: ends[0]], abs=1e-6)
        else:
            assert (c.token_ids, c.finish_reason) == (f.token_ids, f.finish_reason)
    assert 1 <= n_stopped < len(free)


def test_stop_strings_without_a_tokenizer_are_refused(tiny_model, tiny_tokenizer):
    engine = engine_for(tiny_model, tiny_tokenizer)
    with pytest.raises(ValueError, match=r"stop strings .* need a tokenizer"):
        engine.generate([list(prompts(tiny_tokenizer)[0])], SamplingParams(4, stop=("9",)))


def test_stop_token_ids_end_completions(tiny_model, tiny_tokenizer):
    ps = [list(p) for p in prompts(tiny_tokenizer)]
    engine = engine_for(tiny_model, tiny_tokenizer)
    free = engine.generate(ps, SamplingParams(8, temperature=0.0))
    stop_id = free[0].token_ids[1]
    cut = engine.generate(ps, SamplingParams(8, temperature=0.0, stop_token_ids=(stop_id,)))
    for f, c in zip(free, cut):
        k = f.token_ids.index(stop_id) + 1 if stop_id in f.token_ids else len(f.token_ids)
        assert c.token_ids == f.token_ids[:k]
        assert c.finish_reason == ("stop" if stop_id in f.token_ids else f.finish_reason)
