"""Training data that resumes where a checkpoint left it: the same shuffled order, from the
next unseen batch.

Lightning stores the state of a train loader that has ``state_dict``/``load_state_dict`` in the
checkpoint and hands it back after a restart. The position saved is the number of batches the
training loop has *processed* in the epoch (Lightning's own counter), not what the loader's
iterator has yielded: the loop fetches one batch ahead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler


def epoch_order(num_rows: int, epoch: int, seed: int, rank: int = 0, world_size: int = 1) -> list[int]:
    """Rank ``rank``'s shuffled row indices of ``epoch`` (of ``world_size``), the last partial share
    dropped. One process: a seeded generator draws a base seed, then the permutation, each epoch
    (epoch 0 is the order of a shuffling DataLoader with that generator). Several: ``DistributedSampler``'s with ``drop_last`` (``seed + epoch``,
    the first ``world_size * (num_rows // world_size)`` indices interleaved by rank)."""
    per_rank = num_rows // world_size
    if world_size > 1:
        g = torch.Generator().manual_seed(seed + epoch)
        order = torch.randperm(num_rows, generator=g).tolist()
        return order[: per_rank * world_size][rank::world_size]
    g = torch.Generator().manual_seed(seed)
    for _ in range(epoch + 1):
        torch.empty((), dtype=torch.int64).random_(generator=g)  # the loader's base seed
        order = torch.randperm(num_rows, generator=g).tolist()
    return order[:per_rank]


@dataclass(frozen=True)
class BatchRows:
    """Which rows each batch of a run trains on, counted from epoch 0 (whole batches: an epoch's
    last partial one is dropped): the train loader iterates exactly this, and asynchronous
    rollouts are handed it to generate for a batch before the loop reaches it."""

    num_rows: int
    batch_size: int
    seed: int
    rank: int = 0
    world_size: int = 1

    @property
    def per_epoch(self) -> int:
        """Whole batches in an epoch on this rank."""
        return (self.num_rows // self.world_size) // self.batch_size

    def epoch(self, epoch: int) -> list[int]:
        """This rank's row indices of ``epoch``, in the order the loader yields them."""
        return epoch_order(self.num_rows, epoch, self.seed, self.rank, self.world_size)

    def rows(self, batch: int) -> list[int]:
        """The rows of the ``batch``-th batch since epoch 0."""
        if self.per_epoch < 1:
            raise ValueError(
                f"{self.num_rows} rows over {self.world_size} rank(s) make no batch of {self.batch_size}"
            )
        epoch, j = divmod(batch, self.per_epoch)
        return self.epoch(epoch)[j * self.batch_size : (j + 1) * self.batch_size]


class ResumableSampler(DistributedSampler):
    """Shuffled indices (:func:`epoch_order`), reshuffled each epoch, each rank its share; the
    first epoch after a resume starts ``skip`` indices in.

    A ``DistributedSampler`` so that Lightning keeps it (it replaces other samplers on several
    processes); with one process it is a seeded shuffle.
    """

    def __init__(self, dataset: Dataset, *, rank: int, world_size: int, seed: int) -> None:
        super().__init__(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True)
        self.resume_epoch, self.skip = -1, 0

    def resume(self, epoch: int, skip: int) -> None:
        self.resume_epoch, self.skip = epoch, skip

    def permutation(self) -> list[int]:
        """This rank's indices for ``self.epoch``."""
        n = len(self.dataset)  # type: ignore[arg-type]
        return epoch_order(n, self.epoch, self.seed, self.rank, self.num_replicas)

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

    @property
    def plan(self) -> BatchRows:
        """The rows of every batch this loader yields (its sampler's order, whole batches)."""
        sampler = self.sampler
        assert isinstance(sampler, ResumableSampler)
        n = len(sampler.dataset)  # type: ignore[arg-type]
        return BatchRows(n, int(self.batch_size or 1), sampler.seed, sampler.rank, sampler.num_replicas)

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
