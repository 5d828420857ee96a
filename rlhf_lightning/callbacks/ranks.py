"""Every rank of a run must train the same config: checked once when fitting starts."""

from __future__ import annotations

import hashlib

import lightning as L
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf


def config_digest(cfg: DictConfig) -> str:
    """A short digest of the resolved config, less ``output_dir`` (a multirun job hands its
    directory to its other ranks explicitly)."""
    values = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    assert isinstance(values, dict)
    values.pop("output_dir", None)
    return hashlib.sha1(OmegaConf.to_yaml(OmegaConf.create(values)).encode()).hexdigest()[:12]


class SameConfigOnAllRanks(L.Callback):
    """Fails at fit start, naming the ranks, when the processes of one run were given different
    configs (e.g. a launcher that re-ran a sweep, or sampled other hyper-parameters, per rank)."""

    def __init__(self, digest: str) -> None:
        self.digest = digest

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if trainer.world_size < 2 or not (dist.is_available() and dist.is_initialized()):
            return
        digests: list[str | None] = [None] * trainer.world_size
        dist.all_gather_object(digests, self.digest)
        if len(set(digests)) > 1:
            raise RuntimeError(
                "the ranks of this run were given different configs (digest per rank: "
                f"{dict(enumerate(digests))}); every rank must start with the same overrides"
            )
