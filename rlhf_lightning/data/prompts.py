"""Prompt rows for rollout algorithms: sized, map-style datasets of env row indices.

Map-style matters: Lightning pre-fetches one batch ahead, so a dataset that generated
rollouts itself would sample them from stale weights. Rows are just indices; the env turns
them into tasks inside ``training_step``.
"""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from rlhf_lightning.data.resumable import resumable_loader
from rlhf_lightning.strategies import split_global


class RowDataset(Dataset):
    def __init__(self, num_rows: int) -> None:
        self.num_rows = num_rows

    def __len__(self) -> int:
        return self.num_rows

    def __getitem__(self, index: int) -> int:
        return index


def per_rank_batch(dm: L.LightningDataModule, size: int, field: str) -> int:
    """A global batch size split across the trainer's processes (Lightning's distributed sampler
    gives each rank its own rows)."""
    return split_global(size, dm.trainer.world_size if dm.trainer is not None else 1, field)


def _collate(rows: list[int]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long)


class PromptDataModule(L.LightningDataModule):
    """Shuffled train rows in batches of ``prompts_per_step``; eval rows in order."""

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
        return DataLoader(  # its own generator: the iterator then leaves the global RNG alone
            RowDataset(self.eval_rows),
            batch_size=self.eval_batch_size,
            shuffle=False,
            collate_fn=_collate,
            generator=torch.Generator(),
        )
