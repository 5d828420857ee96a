"""``rows_of_batch``: the rows a train loader will yield at a future step, known ahead (the
asynchronous producer generates for them early), must be exactly what the loop then gets."""

from __future__ import annotations

import pytest
import torch

from rlhf_lightning.data.prompts import RowDataset
from rlhf_lightning.data.resumable import ResumableLoader, ResumableSampler, rows_of_batch

EPOCHS = 3


def loader(num_rows: int, batch_size: int, rank: int = 0, world: int = 1, seed: int = 17) -> ResumableLoader:
    """A train loader as ``resumable_loader`` builds it, without a trainer."""
    dataset = RowDataset(num_rows)
    return ResumableLoader(
        dataset,
        batch_size=batch_size,
        sampler=ResumableSampler(dataset, rank=rank, world_size=world, seed=seed),
        drop_last=True,
        generator=torch.Generator().manual_seed(seed),
        position=lambda: (0, 0),
    )


def iterated(dl: ResumableLoader, epochs: int = EPOCHS) -> list[list[int]]:
    """Every batch the loader yields over ``epochs``, epoch set first as Lightning does."""
    sampler = dl.sampler
    assert isinstance(sampler, ResumableSampler)
    batches: list[list[int]] = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        batches += [b.tolist() for b in dl]
    return batches


@pytest.mark.parametrize(
    ("num_rows", "batch_size", "rank", "world"),
    [
        (13, 2, 0, 1),  # one process: 6 batches an epoch, the 13th row dropped
        (12, 3, 0, 1),  # whole batches
        (13, 2, 1, 2),  # rank 1 of 2: 6 indices each (drop_last), 3 batches
        (13, 2, 0, 2),
    ],
)
def test_rows_of_batch_equal_what_iteration_yields(num_rows, batch_size, rank, world):
    dl = loader(num_rows, batch_size, rank, world)
    seen = iterated(dl)
    per_epoch = (num_rows // world) // batch_size  # by hand: this rank's whole batches
    assert len(seen) == EPOCHS * per_epoch
    known = [rows_of_batch(dl, b) for b in range(len(seen))]
    assert known == seen
    for e in range(EPOCHS):  # each epoch: distinct rows, reshuffled
        rows = [r for batch in seen[e * per_epoch : (e + 1) * per_epoch] for r in batch]
        assert len(set(rows)) == len(rows) and all(0 <= r < num_rows for r in rows)
    assert seen[:per_epoch] != seen[per_epoch : 2 * per_epoch]


def test_rows_of_batch_split_the_ranks_rows_between_them():
    ranks = [loader(13, 2, rank, 2) for rank in range(2)]
    for b in range(3 * EPOCHS):
        mine, theirs = (rows_of_batch(dl, b) for dl in ranks)
        assert not set(mine) & set(theirs)  # the same step never trains a row twice


def test_rows_of_batch_ignore_a_resumes_skip_and_match_the_resumed_iteration():
    dl = loader(13, 2)
    expected = [rows_of_batch(dl, b) for b in range(EPOCHS * 6)]
    dl.load_state_dict({"epoch": 1, "batches": 2, "batch_size": 2})  # resumed at epoch 1, batch 2
    sampler = dl.sampler
    assert isinstance(sampler, ResumableSampler)
    assert [rows_of_batch(dl, b) for b in range(EPOCHS * 6)] == expected  # counted from epoch 0
    sampler.set_epoch(1)
    assert [b.tolist() for b in dl] == expected[6 + 2 : 12]  # the loop gets batch 8, 9, ...


def test_indices_of_epoch_leaves_the_samplers_state_alone():
    dl = loader(13, 2, 1, 2)
    sampler = dl.sampler
    assert isinstance(sampler, ResumableSampler)
    sampler.set_epoch(2)
    sampler.resume(2, 4)
    current = list(sampler.permutation())
    other = sampler.indices_of_epoch(0)
    assert sampler.epoch == 2 and (sampler.resume_epoch, sampler.skip) == (2, 4)
    assert other != current and sampler.permutation() == current
    sampler.set_epoch(0)
    assert sampler.permutation() == other
