"""What ``strategy=deepspeed_zero2|deepspeed_zero3`` cannot do here, refused at start-up
(before any model loads), each with the field, its value and what to do instead."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from rlhf_lightning.config.errors import ConfigError, check
from rlhf_lightning.runtime.deepspeed import ZERO3_REFUSED, ZERO_STAGES, deepspeed_missing


def cuda_devices() -> int:
    """The CUDA devices torch sees here (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def process_count(trainer: DictConfig, visible: int) -> int:
    """The training processes ``trainer.devices x trainer.num_nodes`` asks for on ``visible``
    CUDA devices (``auto`` / -1: every one of them)."""
    devices = trainer.devices
    if isinstance(devices, int) and devices > 0:
        per_node = devices
    elif isinstance(devices, (list, tuple)) or OmegaConf.is_list(devices):
        per_node = len(devices)
    elif isinstance(devices, str) and devices.strip().lstrip("-").isdigit() and int(devices) > 0:
        per_node = int(devices)
    else:
        per_node = visible
    return per_node * int(trainer.num_nodes)


def validate_deepspeed(cfg: DictConfig, visible: int | None = None, missing: Any = "check") -> None:
    """``strategy=deepspeed_*``: CUDA, the library, one process, one optimizer, what is wired.

    ``visible``: the CUDA device count (default: torch's); ``missing``: why deepspeed is unusable
    or None (default: look at the environment, only once CUDA is there)."""
    name = cfg.strategy.name
    if name not in ZERO_STAGES:
        return
    check(name != "deepspeed_zero3", "strategy.name", name, ZERO3_REFUSED)
    why = f"strategy={name}"
    accelerator = str(cfg.trainer.accelerator)
    check(
        accelerator in ("auto", "gpu", "cuda"),
        "trainer.accelerator",
        accelerator,
        f"gpu (or auto) with {why}: DeepSpeed runs on CUDA only (Lightning's DeepSpeedStrategy "
        "refuses any other accelerator); on this machine use strategy=ddp or strategy=fsdp",
    )
    visible = cuda_devices() if visible is None else visible
    check(
        visible > 0,
        "strategy.name",
        name,
        "a strategy for this machine: DeepSpeed needs CUDA, and torch sees no CUDA device here "
        "(Lightning's DeepSpeedStrategy refuses to run without one): use strategy=ddp or strategy=fsdp",
    )
    problem = deepspeed_missing() if missing == "check" else missing
    if problem is not None:
        raise ConfigError("strategy.name", name, f"a strategy whose library is installed: {problem}")
    processes = process_count(cfg.trainer, visible)
    check(
        processes == 1,
        "trainer.devices",
        cfg.trainer.devices,
        f"1 (and trainer.num_nodes=1) with {why}: ZeRO reduces gradients inside every backward pass, "
        f"and ranks here run different numbers of them (skipped zero-advantage rows, refills); "
        f"{processes} processes would wait on each other for ever. Several GPUs: strategy=fsdp",
    )
    check(
        cfg.population.size == 1,
        "population.size",
        cfg.population.size,
        f"1 with {why}: a population trains one optimizer per member, and DeepSpeed takes exactly "
        "one optimizer and one schedule (use strategy=ddp or auto for a population)",
    )
    check(
        cfg.model.finetune == "lora",
        "model.finetune",
        cfg.model.finetune,
        f"lora with {why}: only LoRA adapters over a frozen base are wired (full fine-tuning: strategy=fsdp or ddp)",
    )
    check(
        cfg.model.quantization is None,
        "model.quantization",
        cfg.model.quantization,
        f"null with {why}: a bitsandbytes-quantised base is not wired under DeepSpeed (QLoRA: strategy=auto)",
    )
    check(
        cfg.rollout.engine == "hf",
        "rollout.engine",
        cfg.rollout.engine,
        f"hf with {why}: the colocated vLLM engine's weight sync is not wired under DeepSpeed",
    )
    check(
        cfg.algo.get("share_grad_clip", True),
        "algo.share_grad_clip",
        cfg.algo.get("share_grad_clip"),
        f"true with {why}: DeepSpeed clips all gradients by one global norm (algo.grad_clip), "
        "it cannot clip the actor and the critic separately",
    )
    check(
        str(cfg.trainer.precision) not in ("16-mixed", "16", "16-true"),
        "trainer.precision",
        cfg.trainer.precision,
        f"32-true, bf16-mixed or bf16-true with {why}: DeepSpeed's fp16 loss scaling would skip steps "
        "the run's guard does not see",
    )
    resuming = cfg.ckpt_path is not None or bool(cfg.resume)
    check(
        not resuming,
        "ckpt_path" if cfg.ckpt_path is not None else "resume",
        cfg.ckpt_path if cfg.ckpt_path is not None else cfg.resume,
        f"unset with {why}: its checkpoints hold the trainable weights but not ZeRO's partitioned "
        "optimizer state, so a run cannot resume from them; start a new run from the saved adapters "
        "(model.adapter_path=<run>/checkpoints/adapters/last)",
    )
