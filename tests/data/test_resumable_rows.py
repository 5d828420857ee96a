"""``BatchRows``: the rows a train loader will yield at a future step, known ahead (the
asynchronous producer is handed the loader's plan and generates for them early), must be exactly
what the loop then gets; ``epoch_order`` is the order ``DistributedSampler`` gives."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DistributedSampler

from rlhf_lightning.data.prompts import RowDataset
from rlhf_lightning.data.resumable import BatchRows, ResumableLoader, ResumableSampler, epoch_order

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
def test_the_plans_rows_equal_what_iteration_yields(num_rows, batch_size, rank, world):
    dl = loader(num_rows, batch_size, rank, world)
    seen = iterated(dl)
    per_epoch = (num_rows // world) // batch_size  # by hand: this rank's whole batches
    assert len(seen) == EPOCHS * per_epoch
    known = [dl.plan.rows(b) for b in range(len(seen))]
    assert known == seen
    for e in range(EPOCHS):  # each epoch: distinct rows, reshuffled
        rows = [r for batch in seen[e * per_epoch : (e + 1) * per_epoch] for r in batch]
        assert len(set(rows)) == len(rows) and all(0 <= r < num_rows for r in rows)
    assert seen[:per_epoch] != seen[per_epoch : 2 * per_epoch]


def test_the_plans_rows_split_the_ranks_rows_between_them():
    ranks = [loader(13, 2, rank, 2) for rank in range(2)]
    for b in range(3 * EPOCHS):
        mine, theirs = (dl.plan.rows(b) for dl in ranks)
        assert not set(mine) & set(theirs)  # the same step never trains a row twice


def test_the_plans_rows_ignore_a_resumes_skip_and_match_the_resumed_iteration():
    dl = loader(13, 2)
    expected = [dl.plan.rows(b) for b in range(EPOCHS * 6)]
    dl.load_state_dict({"epoch": 1, "batches": 2, "batch_size": 2})  # resumed at epoch 1, batch 2
    sampler = dl.sampler
    assert isinstance(sampler, ResumableSampler)
    assert [dl.plan.rows(b) for b in range(EPOCHS * 6)] == expected  # counted from epoch 0
    sampler.set_epoch(1)
    assert [b.tolist() for b in dl] == expected[6 + 2 : 12]  # the loop gets batch 8, 9, ...


def test_epoch_order_is_distributed_samplers_with_drop_last():
    for n, world in [(13, 2), (12, 3), (7, 4)]:
        for rank in range(world):
            for epoch in range(3):
                ds = DistributedSampler(RowDataset(n), world, rank, shuffle=True, seed=5, drop_last=True)
                ds.set_epoch(epoch)
                assert epoch_order(n, epoch, 5, rank, world) == list(ds)


def test_one_process_first_epoch_is_a_shuffling_loaders():
    n, seed = 11, 3
    plain = torch.utils.data.DataLoader(
        RowDataset(n), batch_size=1, shuffle=True, generator=torch.Generator().manual_seed(seed)
    )
    assert epoch_order(n, 0, seed) == [int(b) for b in plain]
    assert epoch_order(n, 1, seed) != epoch_order(n, 0, seed)


def test_a_plan_without_a_whole_batch_says_so():
    with pytest.raises(ValueError, match="3 rows over 2 rank"):
        BatchRows(3, 2, seed=0, world_size=2).rows(0)
