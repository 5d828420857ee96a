"""Packed rows under flash attention: every sequence gets exactly what it gets alone, with several
rows in the micro-batch (transformers separates packed sequences by positions only in a one-row
batch). The flash path is transformers' own, its kernels exact attention on the CPU
(``flash_emulation``); ``bench/gpu_check.py`` repeats the check with the real kernels."""

from __future__ import annotations

import torch

from rlhf_lightning.models.build import build_policy, load_model
from rlhf_lightning.records.trajectory import segment_positions
from tests.models.flash_emulation import emulated_flash

SEGMENTS = [[7, 5, 9], [11], [4, 8]]  # three rows: 3, 1 and 2 packed sequences (e.g. turns)


def packed_batch(seed: int = 0):
    """Right-padded packed rows; in each sequence the tokens after its first two are actions."""
    g = torch.Generator().manual_seed(seed)
    width = max(sum(s) for s in SEGMENTS) + 2
    ids = torch.zeros(len(SEGMENTS), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    action = torch.zeros(len(SEGMENTS), width - 1, dtype=torch.bool)
    sequences = []
    for row, lens in enumerate(SEGMENTS):
        at = 0
        for n in lens:
            seq = torch.randint(3, 250, (n,), generator=g)
            ids[row, at : at + n], mask[row, at : at + n] = seq, 1
            action[row, at + 1 : at + n - 1] = True  # tokens 2.. of the sequence are predicted
            sequences.append(seq)
            at += n
    return ids, mask, action, segment_positions(SEGMENTS, width), sequences


def alone(model, sequences) -> torch.Tensor:
    """Each sequence's action log-probs, the sequence run by itself (one row, no padding)."""
    out = []
    for seq in sequences:
        logits = model(input_ids=seq[None]).logits[0, :-1].double()
        lp = logits.log_softmax(-1).gather(-1, seq[1:, None]).squeeze(-1)
        out.append(lp[1:])  # the actions: tokens 2.. (predicted at positions 1..)
    return torch.cat(out)


def test_the_emulated_flash_path_mixes_packed_rows_when_given_several_rows(tiny_path):
    """The emulation reproduces the defect: several packed rows in one call attend across their
    sequences (what the policy did before), so the tests below can fail."""
    model = load_model(tiny_path, dtype="float32", attn_implementation="eager")
    ids, _, action, pos, sequences = packed_batch()
    with emulated_flash(model), torch.no_grad():
        logits = model(input_ids=ids, position_ids=pos).logits[:, :-1].double()
    lp = logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)[action]
    with torch.no_grad():
        expected = alone(model, sequences)
    assert (lp - expected).abs().max() > 1e-2


def test_packed_rows_under_flash_attention_equal_each_sequence_alone(tiny_path):
    """Log-probs of a 3-row packed micro-batch through the policy's flash branch equal each
    sequence run alone, and the LoRA gradients equal those of the unpacked (sdpa) path (a float64
    model, so summation order cannot hide a difference)."""
    torch.manual_seed(0)
    model = load_model(tiny_path, dtype="float32", attn_implementation="sdpa").double()  # exact sums
    policy = build_policy(model, finetune="lora", lora_r=4)
    with torch.no_grad():  # a non-zero adapter, so its gradients depend on the attention
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    ids, mask, action, pos, sequences = packed_batch()
    with torch.no_grad():
        expected = alone(policy.causal_lm, sequences)
    params = [p for p in policy.parameters() if p.requires_grad]

    def run() -> tuple[torch.Tensor, list[torch.Tensor]]:
        lp, _ = policy.token_logprobs(ids, mask, action, position_ids=pos)
        grads = torch.autograd.grad(lp.sum(), params)
        return lp[action], list(grads)

    with emulated_flash(policy.model):
        flash, flash_grads = run()
    sdpa, sdpa_grads = run()
    torch.testing.assert_close(flash.double(), expected, rtol=0, atol=2e-5)  # the log-prob op is float32
    torch.testing.assert_close(flash, sdpa, rtol=0, atol=1e-10)
    for f, e in zip(flash_grads, sdpa_grads):
        torch.testing.assert_close(f, e, rtol=0, atol=1e-10)
