"""vLLM servers started by the run (``rollout=vllm_server rollout.servers=null``).

Each server is vLLM's OpenAI-compatible API server (``python -m
vllm.entrypoints.openai.api_server``, what ``vllm serve`` runs) on a free port of 127.0.0.1,
one per entry of ``rollout.server_devices`` (its ``CUDA_VISIBLE_DEVICES``; several devices in
one entry: tensor parallel over them), its output in ``<run>/servers/server-<i>.log``. It runs
under :mod:`~rlhf_lightning.runtime.group_guard`, so the server and its engine process end with
the trainer however it ends (``kill -9`` included), and a server that dies takes its engine
process with it. The server is started with what the run needs: the run's model and dtype,
processed log-probs (the :class:`~rlhf_lightning.records.sampling.Completion` contract), LoRA
slots when the run trains an adapter (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``: adapters load at run
time), and the development endpoints (``VLLM_SERVER_DEV_MODE``, safe on 127.0.0.1) through which
full fine-tuning reloads the weights and resets the prefix cache.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from rlhf_lightning.config.server_args import PROCESSED_LOGPROBS, logprobs_modes
from rlhf_lightning.runtime import local_server
from rlhf_lightning.runtime.local_server import HOST, LocalServer, ServerStartError, free_port

__all__ = ["HOST", "LaunchSpec", "ServerProcess", "ServerStartError", "free_port", "launch", "wait_ready"]
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the ranks vLLM sizes its LoRA slots for
# vLLM's CPU build (0.32) ends its engine with "CPU Generator does not use offset" when a seeded
# request's prefill is split over two steps (chunked prefill rewinds the request's generator; a
# CPU generator cannot). Every request here is seeded, so a CPU server prefills whole prompts.
CPU_SEEDED_REQUESTS = ("--no-enable-chunked-prefill", "--max-num-batched-tokens")


@dataclass(frozen=True)
class LaunchSpec:
    """How the run starts its servers.

    Attributes:
        model_path, tokenizer_path: the run's model (``model.path``, ``model.tokenizer_path``).
        dtype, max_model_len, enforce_eager, enable_prefix_caching, gpu_memory_utilization,
            kv_cache_memory_bytes: as for the colocated engine (``rollout=vllm``); without a
            CUDA device the KV cache is 64 MiB unless ``kv_cache_memory_bytes`` says otherwise.
        lora_rank: the actor's LoRA rank (None: full fine-tuning, no LoRA slots).
        max_loras: LoRA adapters one batch of the server may hold.
        devices: one server per entry, the entry its ``CUDA_VISIBLE_DEVICES`` (``"0,1"``: tensor
            parallel over two GPUs); None: one server on the trainer's own devices.
        extra_args: more arguments for every server (``rollout.server_args``).
        seed: the servers' seed (every request carries its own anyway).
        start_timeout_s: how long a server may take to answer ``/health``.
    """

    model_path: str
    tokenizer_path: str | None = None
    dtype: str = "auto"
    max_model_len: int = 512
    lora_rank: int | None = None
    max_loras: int = 2
    devices: tuple[str, ...] | None = None
    gpu_memory_utilization: float = 0.5
    kv_cache_memory_bytes: int | None = None
    enforce_eager: bool = True
    enable_prefix_caching: bool = True
    extra_args: tuple[str, ...] = field(default_factory=tuple)
    seed: int = 0
    start_timeout_s: float = 600.0


def lora_slot_rank(rank: int) -> int:
    """The smallest LoRA rank vLLM sizes its slots for that holds ``rank``."""
    for r in LORA_RANKS:
        if r >= rank:
            return r
    raise ValueError(f"model.lora.r={rank} is larger than vLLM's largest LoRA rank {LORA_RANKS[-1]}")


def server_command(spec: LaunchSpec, port: int, devices: str | None) -> list[str]:
    """The command line of one server on ``port`` (``devices``: its CUDA devices, or None)."""
    extra = list(spec.extra_args)
    modes = logprobs_modes(extra)
    if any(m != PROCESSED_LOGPROBS for m in modes):
        raise ValueError(
            f"rollout.server_args={extra} sets --logprobs-mode {modes}: the servers need "
            f"{PROCESSED_LOGPROBS} (the log-probs after temperature and filters); remove it"
        )
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", spec.model_path,
        "--tokenizer", spec.tokenizer_path or spec.model_path,
        "--host", HOST, "--port", str(port),
        "--dtype", spec.dtype,
        "--max-model-len", str(spec.max_model_len),
        "--seed", str(spec.seed),
        # the sampled token's log-prob after penalty, temperature and filtering (Completion's kind)
        "--logprobs-mode", PROCESSED_LOGPROBS,
        "--enable-prefix-caching" if spec.enable_prefix_caching else "--no-enable-prefix-caching",
        "--disable-uvicorn-access-log",
    ]  # fmt: skip
    if spec.enforce_eager:
        cmd.append("--enforce-eager")
    if spec.lora_rank is not None:
        cmd += ["--enable-lora", "--max-lora-rank", str(lora_slot_rank(spec.lora_rank))]
        cmd += ["--max-loras", str(spec.max_loras)]
    if devices:
        cmd += ["--tensor-parallel-size", str(len(devices.split(",")))]
    on_gpu = bool(devices) or _has_cuda()
    if on_gpu:
        cmd += ["--gpu-memory-utilization", str(spec.gpu_memory_utilization)]
    if spec.kv_cache_memory_bytes is not None or not on_gpu:
        cmd += ["--kv-cache-memory-bytes", str(spec.kv_cache_memory_bytes or 64 << 20)]
    if not on_gpu:  # whole prefills only: see CPU_SEEDED_REQUESTS
        cmd += [*CPU_SEEDED_REQUESTS, str(max(spec.max_model_len, 2048))]
    return [*cmd, *spec.extra_args]


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def server_env(devices: str | None) -> dict[str, str]:
    """The server's environment: the trainer's, plus runtime LoRA loading and the development
    endpoints (weight reload, prefix-cache reset), and its CUDA devices."""
    env = dict(os.environ)
    env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    env["VLLM_SERVER_DEV_MODE"] = "1"
    if devices:
        env["CUDA_VISIBLE_DEVICES"] = devices
    return env


class ServerProcess(LocalServer):
    """One server the run started: its URL, its guard process and its log
    (:class:`~rlhf_lightning.runtime.local_server.LocalServer`: ``death``, ``where``,
    ``log_tail``, ``healthy``, ``stop``), ``<log_dir>/server-<index>.log``."""

    def __init__(self, spec: LaunchSpec, index: int, log_dir: Path, devices: str | None = None) -> None:
        self.spec, self.index, self.devices = spec, index, devices
        port = free_port()
        super().__init__(
            f"the vLLM server http://{HOST}:{port}",
            server_command(spec, port, devices),
            port,
            Path(log_dir) / f"server-{index}.log",
            env=server_env(devices),
        )


def launch(spec: LaunchSpec, log_dir: Path) -> list[ServerProcess]:
    """Start every server of ``spec`` at once and wait until each answers ``/health``; on any
    failure stop them all and raise :class:`ServerStartError` naming the URL and the log."""
    entries: list[str | None] = list(spec.devices) if spec.devices else [None]
    servers = [ServerProcess(spec, i, log_dir, d) for i, d in enumerate(entries)]
    try:
        for server in servers:
            wait_ready(server, time.monotonic() + spec.start_timeout_s)
    except BaseException:
        for server in servers:
            server.stop(grace_s=2.0)
        raise
    return servers


def wait_ready(server: ServerProcess, deadline: float) -> None:
    """Wait until ``server`` answers ``/health``; raise if it exits or ``deadline`` passes."""
    local_server.wait_ready(
        server,
        deadline,
        f"the vLLM server {server.url}",
        f"/health within {server.spec.start_timeout_s:.0f} s (rollout.server_start_timeout_s)",
    )
