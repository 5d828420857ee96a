"""``strategy=...``: Lightning's distribution strategies, built from the typed ``strategy`` config.

    auto   one process (Lightning picks the device)
    ddp    data parallel, one process per device (gloo on CPUs, nccl on GPUs)

The algorithm config does not change with the strategy: batch sizes are global.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, cast

log = logging.getLogger(__name__)

STRATEGIES = ("auto", "ddp")


def split_global(size: int, world_size: int, field: str) -> int:
    """A global batch size (config field ``field``) split evenly across ``world_size`` ranks."""
    if size % world_size:
        from rlhf_lightning.validation import ConfigError

        raise ConfigError(
            field, size, f"a multiple of the number of processes ({world_size}): batch sizes are global"
        )
    return size // world_size


def build_strategy(s: Any) -> Any:
    """The ``Trainer(strategy=...)`` argument for the ``strategy`` config node."""
    timeout = timedelta(seconds=s.timeout_s)
    if s.name == "auto":
        return "auto"
    if s.name == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy(process_group_backend=s.process_group_backend, timeout=timeout)
    raise ValueError(f"strategy.name must be one of {', '.join(STRATEGIES)}, got {s.name!r}")


def _in_multirun() -> bool:
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode
    except ImportError:
        return False
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


@contextmanager
def distributed_job() -> Iterator[None]:
    """One run's processes and process group, undone afterwards in a Hydra multirun, whose jobs
    share one main process: Lightning's launcher leaves ``LOCAL_RANK``, ``MASTER_PORT``... in the
    environment and the process group alive, and the next job would then skip starting its own
    ranks and talk to the previous job's, which have exited."""
    if not _in_multirun():
        yield
        return
    environ = dict(os.environ)
    try:
        yield
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(environ)


def single_job_argv() -> None:
    """Under a Hydra multirun, Lightning's DDP launcher starts the other ranks with ``sys.argv``:
    the whole sweep, which each rank would then run again (an Optuna sweeper would even sample
    other values for them). Point it at this job alone: its own overrides and output directory."""
    if not _in_multirun() or os.environ.get("LOCAL_RANK", "0") != "0":
        return
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    task = [o for o in hc.overrides.task if not o.startswith("output_dir=")]
    out = str(hc.runtime.output_dir).replace("\\", "\\\\").replace('"', '\\"')  # the job dir holds '='
    sys.argv = [sys.argv[0], *task, f'output_dir="{out}"']
    # Lightning also hands the other ranks ``hydra.run.dir``: make it the job's directory, not
    # the single-run pattern, so they leave nothing elsewhere.
    from omegaconf import open_dict, read_write

    with read_write(cast(Any, hc)), open_dict(cast(Any, hc)):
        hc.run.dir = str(hc.runtime.output_dir)
    log.info("multirun job: other ranks start with %s", sys.argv[1:])
