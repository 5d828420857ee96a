from __future__ import annotations

import pytest
import torch
from peft import PeftModel
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from rlhf_lightning.models.build import build_policy, load_model


def batch(tokenizer, n=4):
    texts = ["What is 12 plus 30?", "Ben has 40 coins and gives away 11. How many coins are left?"] * (n // 2)
    ids = [tokenizer(t).input_ids + [tokenizer.eos_token_id] for t in texts]
    width = max(map(len, ids))
    input_ids = torch.full((n, width), tokenizer.pad_token_id)
    attn = torch.zeros(n, width, dtype=torch.long)
    for i, row in enumerate(ids):
        input_ids[i, : len(row)] = torch.tensor(row)
        attn[i, : len(row)] = 1
    action = torch.zeros(n, width - 1, dtype=torch.bool)
    for i, row in enumerate(ids):
        action[i, 5 : len(row) - 1] = True
    return input_ids, attn, action


def naive_logprobs(model, input_ids, attn, action, temperature=1.0):
    logits = model(input_ids=input_ids, attention_mask=attn).logits[:, :-1].float() / temperature
    lp = logits.log_softmax(-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return lp * action


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_equal_full_logits(tiny_model, tiny_tokenizer, temperature):
    ids, attn, action = batch(tiny_tokenizer)
    expected = naive_logprobs(tiny_model, ids, attn, action, temperature)
    policy = build_policy(tiny_model, finetune="full")
    got, _ = policy.token_logprobs(ids, attn, action, temperature=temperature, chunk_rows=3)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_lora_trains_adapter_only_and_reference_is_base(tiny_path, tiny_tokenizer):
    base = load_model(tiny_path, dtype="float32", attn_implementation="eager")
    ids, attn, action = batch(tiny_tokenizer)
    base_lp = naive_logprobs(base, ids, attn, action)
    frozen = {k: v.clone() for k, v in base.state_dict().items()}
    policy = build_policy(base, finetune="lora", lora_r=4)
    names = [n for n, p in policy.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    opt = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-2)
    for _ in range(3):
        lp, _ = policy.token_logprobs(ids, attn, action)
        (-lp.sum()).backward()
        opt.step()
        opt.zero_grad()
    after, _ = policy.token_logprobs(ids, attn, action)
    assert not torch.allclose(after, base_lp, atol=1e-3), "the adapter did not change the policy"
    ref, _ = policy.token_logprobs(ids, attn, action, reference=True)
    torch.testing.assert_close(ref, base_lp, rtol=0, atol=1e-5)
    base_sd = policy.causal_lm.state_dict()
    for key, value in frozen.items():
        peft_key = next(k for k in base_sd if k.replace(".base_layer", "") == key)
        assert torch.equal(base_sd[peft_key], value), f"base weight {key} changed"


def test_full_finetune_reference_copy(tiny_model, tiny_tokenizer):
    ids, attn, action = batch(tiny_tokenizer)
    before = naive_logprobs(tiny_model, ids, attn, action)
    policy = build_policy(tiny_model, finetune="full", need_reference=True)
    opt = torch.optim.SGD(policy.trainable_parameters(), lr=0.1)
    lp, _ = policy.token_logprobs(ids, attn, action)
    (-lp.sum()).backward()
    opt.step()
    ref, _ = policy.token_logprobs(ids, attn, action, reference=True)
    torch.testing.assert_close(ref, before, rtol=0, atol=1e-5)


def test_saved_adapter_loads_with_peft(tiny_path, tiny_tokenizer, tmp_path):
    policy = build_policy(load_model(tiny_path, dtype="float32"), finetune="lora", lora_r=4)
    with torch.no_grad():
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                p.add_(0.05)
    ids, attn, action = batch(tiny_tokenizer)
    want, _ = policy.token_logprobs(ids, attn, action)
    out = policy.save_adapter(tmp_path / "adapters")
    loaded = PeftModel.from_pretrained(load_model(tiny_path, dtype="float32"), str(out))
    got = naive_logprobs(loaded, ids, attn, action)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def _rms_norm_in_input_dtype(self, hidden_states):
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


@pytest.mark.parametrize("finetune", ["lora", "full"])
@pytest.mark.parametrize("reference", [False, True])
def test_shared_prompt_forward_equals_plain_forward(
    tiny_path, tiny_tokenizer, finetune, reference, monkeypatch
):
    """Rows sharing a prompt run it once; log-probs and gradients must not change."""
    tok = tiny_tokenizer
    prompts = [tok(f"What is {a} plus {b}?").input_ids for a, b in ((12, 30), (7, 5), (40, 41))]
    replies = [tok(r).input_ids + [tok.eos_token_id] for r in ("42", "1", "12", "81 or so", "9")]
    rows = [(0, 0), (0, 1), (1, 2), (0, 3), (2, 4), (1, 0), (2, 2)]  # (prompt, reply), groups interleaved
    seqs = [prompts[p] + replies[r] for p, r in rows]
    width = max(map(len, seqs))
    ids = torch.full((len(rows), width), tok.pad_token_id)
    attn = torch.zeros(len(rows), width, dtype=torch.long)
    action = torch.zeros(len(rows), width - 1, dtype=torch.bool)
    for i, ((p, _), seq) in enumerate(zip(rows, seqs)):
        ids[i, : len(seq)], attn[i, : len(seq)] = torch.tensor(seq), 1
        action[i, len(prompts[p]) - 1 : len(seq) - 1] = True
    prompt_lens = torch.tensor([len(prompts[p]) for p, _ in rows])
    prefix_ids = torch.tensor([p for p, _ in rows])
    # Pure float64: sdpa keeps the input dtype, and Qwen2's RMSNorm (which rounds through float32)
    # is swapped for the same formula in the input dtype.
    monkeypatch.setattr(Qwen2RMSNorm, "forward", _rms_norm_in_input_dtype)
    model = load_model(tiny_path, dtype="float32", attn_implementation="sdpa").double()
    policy = build_policy(model, finetune=finetune, lora_r=4, need_reference=True).double()
    with torch.no_grad():
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                p.add_(0.02)
    params = policy.trainable_parameters()
    results = []
    for shared in (False, True):
        kwargs = {"prompt_lens": prompt_lens, "prefix_ids": prefix_ids} if shared else {}
        logp, ent = policy.token_logprobs(
            ids, attn, action, temperature=0.9, reference=reference, return_entropy=True, **kwargs
        )
        grads = None if reference else torch.autograd.grad((logp * 1.3 + ent * 0.2).sum(), params)
        results.append((logp.detach(), ent.detach(), grads))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=0, atol=1e-10)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=0, atol=1e-10)
    if not reference:
        for a, b in zip(results[1][2], results[0][2]):
            assert ((a - b).norm() / b.norm()).item() < 1e-10
