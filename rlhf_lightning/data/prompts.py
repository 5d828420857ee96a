"""Prompt rows for rollout algorithms: sized, map-style datasets of env row indices.

Map-style matters: Lightning pre-fetches one batch ahead, so a dataset that generated
rollouts itself would sample them from stale weights. Rows are just indices; the env turns
them into tasks inside ``training_step``.

Eval rows are split over the ranks by :class:`EvalRowSampler`, not by Lightning's
``DistributedSampler``: that one pads the rows to a multiple of the number of processes with
repeats, which evaluation would then count twice.
"""

from __future__ import annotations

from collections.abc import Iterator

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from rlhf_lightning.data.resumable import resumable_loader
from rlhf_lightning.runtime.strategies import split_global

PAD_ROW = -1  # an eval slot without a row: see rank_eval_rows


class RowDataset(Dataset):
    """Row indices ``0 .. num_rows - 1``: item ``i`` is row ``i`` (``PAD_ROW`` passes through)."""

    def __init__(self, num_rows: int) -> None:
        self.num_rows = num_rows

    def __len__(self) -> int:
        return self.num_rows

    def __getitem__(self, index: int) -> int:
        return index


def rank_eval_rows(num_rows: int, batch_size: int, rank: int, world_size: int) -> list[int]:
    """Rank ``rank``'s eval rows, in order: ``rank, rank + world_size, ...``, so that every row is
    on exactly one rank; then, if this rank's rows fill fewer batches of ``batch_size`` than the
    rank with the most rows, one ``PAD_ROW`` as a batch of its own.

    Why the padding: every rank must run the same number of validation batches, and so of
    rollouts (under FSDP each rollout all-gathers the weights, a collective). A rank has at most
    one row fewer than another; it then lacks a batch only when its rows fill whole batches,
    so the padding never shares a batch with a row (the batch runs a stand-in, not counted).
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not a rank of {world_size} processes")
    if batch_size < 1:
        raise ValueError(f"eval.batch_size={batch_size}: at least 1")
    rows = list(range(rank, num_rows, world_size))
    most = _ceil_div(num_rows, world_size)  # rank 0's rows
    if _ceil_div(len(rows), batch_size) < _ceil_div(most, batch_size):
        rows.append(PAD_ROW)
    return rows


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class EvalRowSampler(DistributedSampler):
    """This rank's eval rows (:func:`rank_eval_rows`), in batches of ``batch_size``.

    A ``DistributedSampler`` so that Lightning keeps it: with several processes Lightning
    replaces any other sampler by its own (``use_distributed_sampler``), which would pad the
    rows with repeats. With one process: every row, in order.
    """

    def __init__(self, dataset: RowDataset, *, batch_size: int, rank: int, world_size: int) -> None:
        super().__init__(dataset, num_replicas=world_size, rank=rank, shuffle=False)
        self.rows = rank_eval_rows(len(dataset), batch_size, rank, world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)


def _collate(rows: list[int]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long)


def eval_row_loader(dm: L.LightningDataModule, num_rows: int, batch_size: int) -> DataLoader:
    """The eval loader of ``num_rows`` env rows for data module ``dm`` (its trainer gives the
    ranks): each rank its rows (:class:`EvalRowSampler`), batches of ``batch_size`` per rank,
    in order. Its own generator: creating its iterator then leaves the global RNG alone (an
    evaluation would otherwise shift training's random numbers)."""
    trainer = dm.trainer
    rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
    dataset = RowDataset(num_rows)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=EvalRowSampler(dataset, batch_size=batch_size, rank=rank, world_size=world),
        collate_fn=_collate,
        generator=torch.Generator(),
    )


def per_rank_batch(dm: L.LightningDataModule, size: int, field: str) -> int:
    """A global batch size split across the trainer's processes (Lightning's distributed sampler
    gives each rank its own rows)."""
    return split_global(size, dm.trainer.world_size if dm.trainer is not None else 1, field)


class PromptDataModule(L.LightningDataModule):
    """Shuffled train rows in batches of ``prompts_per_step`` (global); eval rows in order, in
    batches of ``eval_batch_size`` per rank, each row on one rank."""

    def __init__(
        self, train_rows: int, eval_rows: int, prompts_per_step: int, eval_batch_size: int, seed: int = 0
    ):
        super().__init__()
        if train_rows < prompts_per_step:
            raise ValueError(
                f"the env's train split has {train_rows} rows, fewer than algo.prompts_per_step={prompts_per_step}"
            )
        self.train_rows, self.eval_rows = train_rows, eval_rows
        self.prompts_per_step, self.eval_batch_size, self.seed = prompts_per_step, eval_batch_size, seed

    def train_dataloader(self) -> DataLoader:
        """Shuffled from ``seed + epoch``, each rank its share; resumes mid-epoch from a checkpoint."""
        return resumable_loader(
            self,
            RowDataset(self.train_rows),
            per_rank_batch(self, self.prompts_per_step, "algo.prompts_per_step"),
            self.seed,
            _collate,
        )

    def val_dataloader(self) -> DataLoader:
        return eval_row_loader(self, self.eval_rows, self.eval_batch_size)
