"""``strategy=...``: Lightning's distribution strategies, built from the typed ``strategy`` config.

    auto   one process (Lightning picks the device)
    ddp    data parallel, one process per device (gloo on CPUs, nccl on GPUs)
    fsdp   FSDP2 (``fully_shard``) through Lightning's ModelParallelStrategy: the frozen base and
           the LoRA adapters of every decoder layer sharded over all processes
    deepspeed_zero2
           Lightning's DeepSpeedStrategy, ZeRO-2, one CUDA process (:mod:`rlhf_lightning.runtime.deepspeed`;
           deepspeed_zero3 composes and is refused at start-up)

The algorithm config does not change with the strategy: batch sizes are global.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.runtime.deepspeed import ZERO_STAGES, deepspeed_strategy

log = logging.getLogger(__name__)

STRATEGIES = ("auto", "ddp", "fsdp", "deepspeed_zero2", "deepspeed_zero3")


def split_global(size: int, world_size: int, field: str) -> int:
    """A global batch size (config field ``field``) split evenly across ``world_size`` ranks."""
    if size % world_size:
        raise ConfigError(
            field, size, f"a multiple of the number of processes ({world_size}): batch sizes are global"
        )
    return size // world_size


def build_strategy(s: Any, grad_clip: float | None = None) -> Any:
    """The ``Trainer(strategy=...)`` argument for the ``strategy`` config node. ``grad_clip``:
    ``algo.grad_clip``, which DeepSpeed applies itself (Lightning's clipping is a no-op there)."""
    timeout = timedelta(seconds=s.timeout_s)
    if s.name == "auto":
        return "auto"
    if s.name == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy(process_group_backend=s.process_group_backend, timeout=timeout)
    if s.name == "fsdp":
        return fsdp2_strategy(s.process_group_backend, timeout)
    if s.name in ZERO_STAGES:
        return deepspeed_strategy(s.name, grad_clip, s.offload_optimizer, s.process_group_backend, timeout)
    raise ValueError(f"strategy.name must be one of {', '.join(STRATEGIES)}, got {s.name!r}")


def fsdp2_strategy(process_group_backend: str | None, timeout: timedelta) -> Any:
    """Lightning's ModelParallelStrategy as pure FSDP2: one data-parallel dimension over every
    process (its ``auto`` sizes would make the processes of a node a tensor-parallel group), and
    checkpoints of the trainable weights only, gathered to one file by rank 0.

    Why ModelParallelStrategy and not FSDPStrategy: the latter wraps modules in FSDP1, whose
    flat parameters mix badly with LoRA (frozen and trainable weights in one unit) and with a
    policy that reads its lm head outside any forward; FSDP2 shards each parameter on its own.
    The sharding itself is the module's ``configure_model`` (:mod:`rlhf_lightning.models.sharding`).
    """
    from lightning.pytorch.strategies import ModelParallelStrategy

    from rlhf_lightning.runtime.distributed import is_dtensor

    class FSDP2Strategy(ModelParallelStrategy):
        def setup_environment(self) -> None:
            self._data_parallel_size = self.num_nodes * self.num_processes
            self._tensor_parallel_size = 1
            super().setup_environment()

        def lightning_module_state_dict(self) -> dict[str, Any]:
            module = cast(Any, self.lightning_module)
            keep = module.checkpoint_keys()
            out = {}
            for name, p in module.named_parameters():
                if name in keep:  # every rank gathers, in the same order; rank 0 keeps
                    full = p.full_tensor() if is_dtensor(p) else p
                    if self.global_rank == 0:
                        out[name] = full.detach().cpu()
            return out

    return FSDP2Strategy(
        save_distributed_checkpoint=False, process_group_backend=process_group_backend, timeout=timeout
    )


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


def pass_output_dir_to_other_ranks(output_dir: Path) -> None:
    """Lightning's launcher starts the other ranks with ``sys.argv``: give them the directory
    this rank claimed (it may differ from the one they would compose). Multiruns: see
    :func:`single_job_argv`."""
    if _in_multirun():
        return
    quoted = str(output_dir).replace("\\", "\\\\").replace('"', '\\"')
    sys.argv = [a for a in sys.argv if not a.startswith("output_dir=")] + [f'output_dir="{quoted}"']


def single_job_argv(output_dir: Path | None = None) -> None:
    """Under a Hydra multirun, Lightning's DDP launcher starts the other ranks with ``sys.argv``:
    the whole sweep, which each rank would then run again (an Optuna sweeper would even sample
    other values for them). Point it at this job alone: its own overrides and output directory."""
    if not _in_multirun() or os.environ.get("LOCAL_RANK", "0") != "0":
        return
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    task = [o for o in hc.overrides.task if not o.startswith("output_dir=")]
    job_dir = output_dir or hc.runtime.output_dir
    out = str(job_dir).replace("\\", "\\\\").replace('"', '\\"')  # the job dir holds '='
    sys.argv = [sys.argv[0], *task, f'output_dir="{out}"']
    # Lightning also hands the other ranks ``hydra.run.dir``: make it the job's directory, not
    # the single-run pattern, so they leave nothing elsewhere.
    from omegaconf import open_dict, read_write

    with read_write(cast(Any, hc)), open_dict(cast(Any, hc)):
        hc.run.dir = str(job_dir)
    log.info("multirun job: other ranks start with %s", sys.argv[1:])
