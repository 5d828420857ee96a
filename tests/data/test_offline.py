"""SFT packing: several examples per row must give exactly the loss and gradients of one per row."""

from __future__ import annotations

import json

import pytest
import torch
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from rlhf_lightning.config import ASSETS
from rlhf_lightning.data.offline import OfflineCollator, SFTDataset, pack_trajectories
from rlhf_lightning.models.build import build_policy, load_model
from rlhf_lightning.rollout.episodes.harness import ChatFormatter

KEYS = {"messages": "messages", "prompt": "prompt", "completion": "completion"}


def _rms_norm_in_input_dtype(self, hidden_states):
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def _examples(tokenizer, n: int):
    rows = [json.loads(line) for line in (ASSETS / "sft_arithmetic.jsonl").open().readlines()[:n]]
    rows.append(
        {
            "messages": [
                {"role": "user", "content": "2 plus 2?"},
                {"role": "assistant", "content": "4"},
                {"role": "user", "content": "And 3 plus 3?"},
                {"role": "assistant", "content": "6"},
            ]
        }
    )
    data = SFTDataset(rows, ChatFormatter(tokenizer, "Answer with a number."), KEYS)
    return [data[i] for i in range(len(data))]


def test_packing_fills_rows_in_order_and_restarts_positions(tiny_tokenizer):
    items = _examples(tiny_tokenizer, 9)
    lens = [len(item[0].token_ids) for item in items]
    max_len = 2 * max(lens) + 3
    rows, seg = pack_trajectories([item[0] for item in items], max_len)
    assert sorted(n for s in seg for n in s) == sorted(lens) and len(rows) < len(items)
    assert all(sum(s) <= max_len for s in seg)
    assert [len(r.token_ids) for r in rows] == [sum(s) for s in seg]
    batch = OfflineCollator(tiny_tokenizer.pad_token_id, max_len, pack=True)(items)
    assert batch.position_ids is not None
    for i, s in enumerate(seg):
        want = torch.cat([torch.arange(n) for n in s])
        assert torch.equal(batch.position_ids[i, : sum(s)], want)
    # every assistant token is still an action, exactly once
    plain = OfflineCollator(tiny_tokenizer.pad_token_id, max_len)(items)
    assert int(batch.action_mask.sum()) == int(plain.action_mask.sum())


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_rows_give_the_unpacked_loss_and_gradients(tiny_path, tiny_tokenizer, monkeypatch, attn):
    # float64 throughout (Qwen2's RMSNorm otherwise rounds through float32); eager attention
    # still takes its softmax in float32, hence its looser tolerance.
    monkeypatch.setattr(Qwen2RMSNorm, "forward", _rms_norm_in_input_dtype)
    model = load_model(tiny_path, dtype="float32", attn_implementation=attn).double()
    policy = build_policy(model, finetune="lora", lora_r=4).double()
    with torch.no_grad():
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                p.add_(0.02)
    items = _examples(tiny_tokenizer, 9)
    max_len = 2 * max(len(item[0].token_ids) for item in items) + 3
    params = policy.trainable_parameters()
    results = []
    for pack in (False, True):
        batch = OfflineCollator(tiny_tokenizer.pad_token_id, max_len, pack=pack)(items)
        logp, _ = policy.token_logprobs(
            batch.input_ids,
            batch.attention_mask,
            batch.action_mask,
            prompt_lens=batch.prompt_lens,
            prefix_ids=batch.prefix_ids,
            position_ids=batch.position_ids,
        )
        nll = -logp[batch.action_mask]  # per token, compared as sorted multisets
        loss = nll.sum()
        grads = torch.autograd.grad(loss, params)
        results.append((loss.detach(), sorted(nll.detach().tolist()), grads, len(batch)))
    assert results[1][3] < results[0][3]  # packing did pack
    tol = 1e-10 if attn == "sdpa" else 1e-6
    torch.testing.assert_close(results[1][0], results[0][0], rtol=tol, atol=0)
    torch.testing.assert_close(torch.tensor(results[1][1]), torch.tensor(results[0][1]), rtol=0, atol=tol)
    for a, b in zip(results[1][2], results[0][2]):
        assert ((a - b).norm() / b.norm()).item() < tol
