"""IPO's sequence scores: log-probs averaged over each response's tokens (see
``rlhf_lightning.losses.preference.sequence_logps``), DPO's summed; both by hand."""

from __future__ import annotations

import pytest
import torch

from rlhf_lightning.algorithms.dpo import DPOModule
from rlhf_lightning.config import DPOConfig
from rlhf_lightning.records.trajectory import Trajectory, collate

# token log-probs of the 4 rows (chosen 0, chosen 1, rejected 0, rejected 1) at positions 1..3
POLICY = torch.tensor([[0, -1.0, -2.0, -3.0], [0, -0.5, 0, 0], [0, -4.0, -4.0, 0], [0, -1.0, -1.0, -1.0]])
REFERENCE = torch.tensor([[0, -2.0, -2.0, -2.0], [0, -1.0, 0, 0], [0, -3.0, -3.0, 0], [0, -1.5, -1.5, -1.5]])
LENGTHS = [3, 1, 2, 3]  # response tokens of each row


class StubPolicy(torch.nn.Module):
    def forward_heads(self, sub, heads, reference=False, **kwargs):
        table = REFERENCE if reference else POLICY
        rows = sub.prefix_ids.tolist()  # each row has its own prompt here
        return {"logp": table[rows][:, : sub.action_mask.shape[1]] * sub.action_mask}

    def token_logprobs(self, input_ids, attention_mask, action_mask, *, prefix_ids, reference=False, **kw):
        table = REFERENCE if reference else POLICY
        return table[prefix_ids.tolist()][:, : action_mask.shape[1]] * action_mask, None


def pairs():
    rows = []
    for i, n in enumerate(LENGTHS):
        tokens = [1, 2 + i, *range(10, 10 + n)]  # a distinct prompt token per row
        rows.append(Trajectory(tokens, [-1, -1] + [0] * n, [0.0] * len(tokens), [0.0], i, prompt_len=2))
    return collate(rows, pad_token_id=0)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_preference_loss_by_hand(loss_type):
    beta = 0.5
    module = DPOModule(StubPolicy(), DPOConfig(loss_type=loss_type, beta=beta))  # type: ignore[arg-type]
    losses, _ = module.pair_loss(pairs())
    pol = [float(POLICY[i, 1 : 1 + n].sum()) for i, n in enumerate(LENGTHS)]
    ref = [float(REFERENCE[i, 1 : 1 + n].sum()) for i, n in enumerate(LENGTHS)]
    if loss_type == "ipo":  # averaged over each response's own tokens
        pol = [p / n for p, n in zip(pol, LENGTHS)]
        ref = [r / n for r, n in zip(ref, LENGTHS)]
    want = []
    for w, lo in ((0, 2), (1, 3)):
        h = (pol[w] - ref[w]) - (pol[lo] - ref[lo])
        if loss_type == "ipo":
            want.append((h - 1 / (2 * beta)) ** 2)
        else:
            want.append(-torch.nn.functional.logsigmoid(torch.tensor(beta * h)).item())
    torch.testing.assert_close(losses, torch.tensor(want), rtol=1e-6, atol=1e-7)
