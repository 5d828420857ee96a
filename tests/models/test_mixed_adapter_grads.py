"""One forward and backward over rows of several LoRA adapters (PEFT's per-row ``adapter_names``,
taken in eval mode; LoRA dropout 0 makes that forward the training one): each adapter gets the
gradient of its own rows alone, and nothing from the others' (the ground a batched population
update would stand on)."""

from __future__ import annotations

import torch

from tests.rollout.test_hf_mixed_adapters import MEMBERS, members_policy


def token_loss(peft, ids: torch.Tensor, adapters: list[str]) -> torch.Tensor:
    """Sum over rows of the mean token NLL of row i under ``adapters[i]``."""
    peft.eval()
    logits = peft(input_ids=ids, attention_mask=torch.ones_like(ids), adapter_names=adapters).logits
    logp = logits[:, :-1].float().log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return (-logp.mean(-1)).sum()


def lora_grads(peft, name: str) -> torch.Tensor:
    return torch.cat(
        [
            (p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
            for n, p in peft.named_parameters()
            if f".{name}." in n and "lora_" in n
        ]
    )


def test_a_mixed_backward_gives_each_adapter_its_own_rows_gradient(tiny_path):
    peft = members_policy(tiny_path).model
    for n, p in peft.named_parameters():
        p.requires_grad_("lora_" in n)
    ids = torch.randint(3, 300, (6, 12), generator=torch.Generator().manual_seed(0))
    owners = [MEMBERS[i % len(MEMBERS)] for i in range(len(ids))]  # interleaved rows
    token_loss(peft, ids, owners).backward()
    mixed = {m: lora_grads(peft, m).clone() for m in MEMBERS}
    for m in MEMBERS:
        rows = [i for i, o in enumerate(owners) if o == m]
        peft.zero_grad()
        token_loss(peft, ids[rows], [m] * len(rows)).backward()
        alone = lora_grads(peft, m)
        assert alone.abs().max() > 1e-3  # the rows do move this adapter
        torch.testing.assert_close(mixed[m], alone, atol=1e-6, rtol=1e-5)
        others = [lora_grads(peft, o) for o in MEMBERS if o != m]
        assert all(g.abs().max() == 0 for g in others)  # its rows alone touch no other adapter
