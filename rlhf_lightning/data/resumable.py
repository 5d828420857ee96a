"""Training data that resumes where a checkpoint left it: the same shuffled order, from the
next unseen batch.

Lightning stores the state of a train loader that has ``state_dict``/``load_state_dict`` in the
checkpoint and hands it back after a restart. The position saved is the number of batches the
training loop has *processed* in the epoch (Lightning's own counter), not what the loader's
iterator has yielded: the loop fetches one batch ahead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class ResumableSampler(DistributedSampler):
    """Shuffled indices, reshuffled each epoch, each rank its share; the first epoch after a
    resume starts ``skip`` indices in.

    A ``DistributedSampler`` so that Lightning keeps it (it replaces other samplers on several
    processes); with one process it is a seeded shuffle.
    """

    def __init__(self, dataset: Dataset, *, rank: int, world_size: int, seed: int) -> None:
        super().__init__(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True)
        self.resume_epoch, self.skip = -1, 0

    def resume(self, epoch: int, skip: int) -> None:
        self.resume_epoch, self.skip = epoch, skip

    def permutation(self) -> list[int]:
        """This rank's indices for ``self.epoch``. One process: the order torch's shuffling
        DataLoader gave before (a seeded generator that draws the loader's base seed, then the
        permutation, each epoch), so single-process runs keep their data order. Several:
        ``DistributedSampler``'s (``seed + epoch``, interleaved by rank)."""
        if self.num_replicas > 1:
            return list(super().__iter__())
        g = torch.Generator().manual_seed(self.seed)
        for _ in range(self.epoch + 1):
            torch.empty((), dtype=torch.int64).random_(generator=g)  # the loader's base seed
            order = torch.randperm(len(self.dataset), generator=g)  # type: ignore[arg-type]
        usable = self.num_samples  # drop_last: the same length as the distributed case
        return order[:usable].tolist()

    def indices_of_epoch(self, epoch: int) -> list[int]:
        """This rank's indices of ``epoch`` (:meth:`permutation` of that epoch; no state changes)."""
        current = self.epoch
        self.epoch = epoch
        try:
            return self.permutation()
        finally:
            self.epoch = current

    def __iter__(self) -> Iterator[int]:
        indices = self.permutation()
        if self.epoch == self.resume_epoch:
            indices = indices[self.skip :]
            self.resume_epoch, self.skip = -1, 0
        return iter(indices)


class ResumableLoader(DataLoader):
    """A train loader whose position in the epoch goes into the checkpoint.

    Args:
        position: ``() -> (epoch, batches processed in it)``, read when a checkpoint is saved.
        (the rest: ``DataLoader``'s; ``sampler`` must be a :class:`ResumableSampler`)
    """

    def __init__(self, *args: Any, position: Callable[[], tuple[int, int]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.position = position

    def state_dict(self) -> dict[str, int]:
        epoch, batches = self.position()
        return {"epoch": epoch, "batches": batches, "batch_size": int(self.batch_size or 1)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["batch_size"] != self.batch_size:
            raise ValueError(
                f"the checkpoint was saved with {state['batch_size']} rows per batch and rank, this run "
                f"has {self.batch_size}: resume with the same batch size and number of processes"
            )
        sampler = self.sampler
        assert isinstance(sampler, ResumableSampler)
        sampler.resume(state["epoch"], state["batches"] * state["batch_size"])


def rows_of_batch(loader: DataLoader, batch: int) -> list[int]:
    """The rows the train ``loader`` yields as its ``batch``-th batch since epoch 0 (full epochs
    of whole batches, as its sampler drops the last partial one): what the training loop will
    receive at that step, known ahead (asynchronous rollouts generate for it early)."""
    sampler, size = loader.sampler, int(loader.batch_size or 1)
    assert isinstance(sampler, ResumableSampler)
    per_epoch = len(sampler) // size
    epoch, j = divmod(batch, per_epoch)
    return sampler.indices_of_epoch(epoch)[j * size : (j + 1) * size]


def resumable_loader(
    dm: Any, dataset: Dataset, batch_size: int, seed: int, collate_fn: Callable[[list[Any]], Any]
) -> ResumableLoader:
    """The train loader of data module ``dm`` (its trainer gives the ranks and the position)."""
    trainer = dm.trainer
    rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)

    def position() -> tuple[int, int]:
        t = dm.trainer
        return t.current_epoch, t.fit_loop.epoch_loop.batch_progress.current.processed

    return ResumableLoader(
        dataset,
        batch_size=batch_size,
        sampler=ResumableSampler(dataset, rank=rank, world_size=world, seed=seed),
        drop_last=True,
        collate_fn=collate_fn,
        generator=torch.Generator().manual_seed(seed),  # leaves the global RNG alone
        position=position,
    )
