"""``rollout=vllm_server`` from config: the servers' settings, the engine of a synchronous run,
and the asynchronous rollouts of ``rollout.mode=async`` (docs/guides/inference-servers.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from rlhf_lightning.rollout.asynchronous.driver import AsyncDriver
from rlhf_lightning.rollout.asynchronous.plan import AsyncSettings
from rlhf_lightning.rollout.asynchronous.servers import ServerTransport
from rlhf_lightning.rollout.episodes.harness import RolloutHarness
from rlhf_lightning.rollout.servers.client import RequestPolicy
from rlhf_lightning.rollout.servers.engine import ServerSettings, VLLMServerEngine
from rlhf_lightning.rollout.servers.process import LaunchSpec


def launch_spec(cfg: DictConfig) -> LaunchSpec:
    """How the run starts its servers (``rollout.servers=null``)."""
    r, m = cfg.rollout, cfg.model
    return LaunchSpec(
        m.path,
        m.tokenizer_path,
        dtype=r.dtype if r.dtype != "auto" else m.dtype,
        max_model_len=r.max_model_len or cfg.env.max_model_len,
        lora_rank=m.lora.r if m.finetune == "lora" else None,
        max_loras=r.max_loras,
        devices=tuple(r.server_devices) if r.server_devices is not None else None,
        gpu_memory_utilization=r.gpu_memory_utilization,
        kv_cache_memory_bytes=r.kv_cache_memory_bytes,
        enforce_eager=r.enforce_eager,
        enable_prefix_caching=r.enable_prefix_caching,
        extra_args=tuple(r.server_args),
        seed=cfg.seed,
        start_timeout_s=r.server_start_timeout_s,
    )


def server_settings(cfg: DictConfig, output_dir: Path | None) -> ServerSettings:
    """The ``rollout`` node's servers: versions in ``<run>/server_weights``, started servers'
    logs in ``<run>/servers`` (temporary directories without a run directory), the checkpoints a
    dead server's message names in ``<run>/checkpoints``."""
    r = cfg.rollout
    given = r.servers is not None
    return ServerSettings(
        urls=tuple(r.servers) if given else None,
        launch=None if given else launch_spec(cfg),
        lora=cfg.model.finetune == "lora",
        max_concurrency=r.max_concurrency,
        request=RequestPolicy(r.request_timeout_s, r.request_retries),
        start_timeout_s=r.server_start_timeout_s,
        sync_dir=r.sync_dir or (str(output_dir / "server_weights") if output_dir is not None else None),
        log_dir=str(output_dir / "servers") if output_dir is not None else None,
        served_model_name=r.served_model_name,
        checkpoint_dir=str(output_dir / "checkpoints") if output_dir is not None else None,
    )


def server_engine(cfg: DictConfig, output_dir: Path | None) -> VLLMServerEngine:
    return VLLMServerEngine(server_settings(cfg, output_dir))


def server_rollouts(
    cfg: DictConfig, output_dir: Path | None, settings: AsyncSettings, harness: RolloutHarness, policy: Any
) -> AsyncDriver:
    """``rollout.mode=async`` on the servers: ``harness`` (one of its own) runs the episodes on a
    thread of the trainer, ``policy`` is published after every update."""
    lockstep = settings.max_staleness == 0
    transport = ServerTransport(server_engine(cfg, output_dir), harness, policy, lockstep)
    return AsyncDriver(transport, settings, cfg.env.max_turns)
