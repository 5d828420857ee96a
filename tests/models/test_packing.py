"""Packed rows run as separate sequences, and what every sequence starts with runs once."""

from __future__ import annotations

import torch

from rlhf_lightning.models.packing import common_prefix, sequence_layout, unpacked_action_rows
from rlhf_lightning.records.trajectory import segment_positions


def test_the_layout_puts_each_token_at_its_sequence_and_position():
    pos = segment_positions([[3, 2], [4]], 6)  # row 0: two sequences, row 1: one, right-padded
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]])
    _, seq, p, count, longest = sequence_layout(pos, mask)
    assert count == 3 and longest == 4
    assert seq.tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 2] and p.tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3]


def test_the_common_prefix_stops_at_the_first_action():
    ids = torch.tensor([[5, 6, 7, 8, 9, 1], [5, 6, 7, 8, 2, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]])
    acts = torch.zeros(2, 6, dtype=torch.bool)
    import rlhf_lightning.models.packing as packing

    old, packing.MIN_SHARED = packing.MIN_SHARED, 2
    try:
        assert common_prefix(ids, mask, acts) == 4
        acts[1, 2] = True  # token 3 of row 1 is an action: position 2 predicts it
        assert common_prefix(ids, mask, acts) == 3
    finally:
        packing.MIN_SHARED = old
    assert common_prefix(ids, mask, torch.zeros(2, 6, dtype=torch.bool)) == 0  # shorter than MIN_SHARED


def test_the_shared_prefix_runs_once(tiny_model):
    """Three sequences that start with the same 20 tokens: the body runs them once (one row),
    then each sequence's rest on that cache; the hidden states equal a plain forward."""
    torch.manual_seed(0)
    body = tiny_model.get_decoder()
    prefix = torch.randint(3, 200, (20,)).tolist()
    seqs = [prefix + torch.randint(3, 200, (n,)).tolist() for n in (5, 9, 7)]
    row = [t for s in seqs for t in s]  # one packed row
    ids = torch.tensor([row])
    mask = torch.ones_like(ids)
    pos = segment_positions([[len(s) for s in seqs]], len(row))
    act = torch.zeros(1, len(row) - 1, dtype=torch.bool)
    starts = [0, len(seqs[0]), len(seqs[0]) + len(seqs[1])]
    for s, seq in zip(starts, seqs):
        act[0, s + 21 : s + len(seq) - 1] = True  # the tokens after the prefix (and one more) are actions
    calls = []
    original = body.forward

    def spy(*args, **kwargs):
        calls.append(tuple(kwargs["input_ids"].shape))
        return original(*args, **kwargs)

    body.forward = spy
    try:
        rows = unpacked_action_rows(body, ids, mask, pos, act, share_prefix=True)
        plain = unpacked_action_rows(body, ids, mask, pos, act, share_prefix=False)
    finally:
        body.forward = original
    # the prefix once (all but its last token, which runs with each rest), then the rests
    assert calls[:2] == [(1, 19), (3, max(len(s) for s in seqs) - 19)]
    assert calls[2] == (3, max(len(s) for s in seqs))  # without sharing: every sequence whole
    torch.testing.assert_close(rows, plain, rtol=0, atol=1e-5)
