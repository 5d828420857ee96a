"""The Liger objective equals the standard one on a real (tiny) policy, for every objective,
aggregation, KL and importance-weight setting that validation lets through to Liger."""

from __future__ import annotations

import pytest
import torch

from rlhf_lightning.learner.liger_path import LigerObjective, liger_unsupported
from rlhf_lightning.learner.objective import KLTerm, MicroBatch, PolicyObjective, PolicyTerm
from rlhf_lightning.models.build import build_policy
from rlhf_lightning.ops.liger import liger_available
from rlhf_lightning.records.trajectory import Trajectory, collate
from tests.ops.test_liger import CASES

pytestmark = pytest.mark.skipif(not liger_available(), reason="liger-kernel is not installed")


def batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(4):
        n = int(torch.randint(2, 6, (1,), generator=g))
        tokens = [1, 7, 9 + i % 2, *torch.randint(3, 200, (n,), generator=g).tolist()]
        logps = [0.0] * 3 + (-torch.rand(n, generator=g)).tolist()
        rows.append(Trajectory(tokens, [-1] * 3 + [0] * n, logps, [0.0], i // 2, prompt_len=3))
    return collate(rows, pad_token_id=0)


@pytest.mark.parametrize("tis_cap", [None, 1.5])
@pytest.mark.parametrize(
    "h", CASES, ids=lambda h: f"{h.loss}-{h.loss_agg_mode}-beta{h.beta}-iw{h.kl_importance_weighted}"
)
def test_liger_objective_equals_ours(tiny_model, h, tis_cap):
    h.mask_truncated, h.offpolicy_token_bounds, h.offpolicy_seq_threshold, h.module = (
        False,
        None,
        None,
        "grpo",
    )
    assert liger_unsupported(h) is None
    torch.manual_seed(0)
    policy = build_policy(tiny_model, need_reference=h.beta > 0)
    with torch.no_grad():  # move the actor away from the reference
        for p in policy.trainable_parameters():
            p.add_(0.05 * torch.randn_like(p))
    traj = batch(1)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        cur = policy.forward_heads(traj, ("logp",), temperature=0.9)["logp"]
        ref = policy.forward_heads(traj, ("logp",), temperature=0.9, reference=True)["logp"]
    old = (cur + 0.1 * torch.randn(cur.shape, generator=g)) * traj.action_mask
    mb = MicroBatch(
        sub=traj,
        index=torch.arange(len(traj)),
        adv=torch.randn(len(traj), generator=g),
        mask=traj.action_mask,
        old_logp=old,
        ref_logp=ref if h.beta > 0 else None,
    )
    norm = {"num_tokens": traj.action_mask.sum().float() + 3.0, "num_seqs": torch.tensor(6.0)}
    kl_term = KLTerm(h.beta, "k3", None, h.kl_importance_weighted) if h.beta > 0 else None
    ours = PolicyObjective(
        PolicyTerm.bind(h.loss, h),
        agg_mode=h.loss_agg_mode,
        max_len=8,
        temperature=0.9,
        kl_term=kl_term,
        tis_cap=tis_cap,
    )
    theirs = LigerObjective(h, temperature=0.9, chunk_rows=None, max_len=8, tis_cap=tis_cap, compiled=False)
    params = policy.trainable_parameters()
    results = []
    for objective in (ours, theirs):
        loss, metrics = objective(policy, mb, norm, lambda x: None)
        results.append((loss.detach(), torch.autograd.grad(loss, params), metrics))
    (l1, g1, m1), (l2, g2, m2) = results
    torch.testing.assert_close(l2, l1, rtol=1e-5, atol=1e-6)
    for a, b in zip(g2, g1):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    if tis_cap is not None:
        torch.testing.assert_close(m2["is/clip_frac"], m1["is/clip_frac"])
