"""Start-up checks: every invalid value fails before any model is loaded, with one message
naming the field, the value and what is allowed."""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from rlhf_lightning.algorithms.checks import resolve_algo
from rlhf_lightning.callbacks.configured import check_configured_callbacks
from rlhf_lightning.config.algo import registered_name
from rlhf_lightning.config.early import LOGGERS, early_checks, is_typed, validate_optim
from rlhf_lightning.config.errors import ConfigError, check
from rlhf_lightning.config.sections import OPENENV_TARGET, check_constructor_kwargs
from rlhf_lightning.losses import POLICY_LOSSES
from rlhf_lightning.models.kernels import QUANT_TYPES, gpu_model_problem
from rlhf_lightning.rollout.episodes.stepping import STEP_WORKERS
from rlhf_lightning.run.deepspeed_checks import validate_deepspeed
from rlhf_lightning.runtime.strategies import STRATEGIES, split_global


def validate_model(m: DictConfig) -> None:
    """What ``early_checks`` leaves of ``model.*``: quantization and kernels."""
    check(m.quant_type in QUANT_TYPES, "model.quant_type", m.quant_type, f"one of {', '.join(QUANT_TYPES)}")
    problem = gpu_model_problem(m.quantization, m.liger_kernels, m.finetune)
    if problem is not None:
        raise ConfigError(*problem)


def typed_algo(cfg: DictConfig) -> Any:
    """The family of ``cfg.algo`` (its spec), with ``cfg.algo`` typed by the family's schema.

    A YAML that does not start from the schema (e.g. a family defined outside this package)
    is merged into it here, so unknown keys and wrong types still fail with the field named.
    """
    from rlhf_lightning.algorithms.spec import get_algorithm

    try:
        spec = get_algorithm(str(cfg.algo.module))
    except KeyError as err:
        raise ConfigError("algo.module", cfg.algo.get("module"), str(err.args[0])) from None
    if OmegaConf.get_type(cfg.algo) is not spec.schema:
        try:
            merged = OmegaConf.merge(OmegaConf.structured(spec.schema), cfg.algo)
        except Exception as err:  # omegaconf's ValidationError / ConfigKeyError name the key
            raise ConfigError(
                "algo", cfg.algo.get("name"), f"does not fit {spec.schema.__name__}: {err}"
            ) from None
        with open_dict(cfg):
            cfg.algo = merged
    return spec


def validate_strategy(cfg: DictConfig) -> None:
    s = cfg.strategy
    check(
        s.name in STRATEGIES,
        "strategy.name",
        s.name,
        f"one of {', '.join(STRATEGIES)}",
    )
    check(s.timeout_s > 0, "strategy.timeout_s", s.timeout_s, "> 0 seconds")
    if s.name == "fsdp":
        validate_fsdp(cfg)
    validate_deepspeed(cfg)  # strategy=deepspeed_*: CUDA, the library, what it cannot do
    devices = cfg.trainer.devices
    if not isinstance(devices, int) or devices < 2:
        return  # "auto" or one device: checked again once the trainer knows the world size
    world = devices * cfg.trainer.num_nodes
    a = cfg.algo
    for field in ("prompts_per_step", "mini_batch_size", "micro_batch_size", "batch_size"):
        size = a.get(field)
        if size is not None:
            split_global(size, world, f"algo.{field}")


def validate_fsdp(cfg: DictConfig) -> None:
    """What ``strategy=fsdp`` cannot do here yet, refused before anything starts."""
    why = "strategy=fsdp"
    check(
        cfg.model.finetune == "lora",
        "model.finetune",
        cfg.model.finetune,
        f"lora with {why}: it shards the frozen base under the adapters (full fine-tuning: strategy=ddp)",
    )
    check(
        cfg.rollout.engine == "hf",
        "rollout.engine",
        cfg.rollout.engine,
        f"hf with {why}: the colocated vLLM engine is not tested under FSDP yet (use strategy=ddp)",
    )
    check(
        not cfg.algo.get("use_liger_loss", False),
        "algo.use_liger_loss",
        cfg.algo.get("use_liger_loss"),
        f"false with {why}: the fused Liger loss is not tested under FSDP yet",
    )
    check(
        str(cfg.trainer.precision) not in ("16-mixed", "16"),
        "trainer.precision",
        cfg.trainer.precision,
        f"32-true, bf16-mixed or bf16-true with {why} (fp16 loss scaling of sharded gradients is not wired)",
    )


def validate_reference(a: DictConfig, cfg: DictConfig, spec: Any) -> None:
    """``algo.ref_update_interval`` moves a separate reference adapter that the algorithm uses."""
    if a.ref_update_interval is None:
        return
    check(
        spec.needs_reference(a),
        "algo.ref_update_interval",
        a.ref_update_interval,
        f"null: algo.module={a.module} does not use a reference here (e.g. algo.beta=0)",
    )
    check(
        cfg.model.finetune == "lora" and a.use_separate_reference_adapter,
        "algo.ref_update_interval",
        a.ref_update_interval,
        "null, or set algo.use_separate_reference_adapter=true with model.finetune=lora: the default "
        "reference (the base with adapters disabled) cannot move",
    )


def checkpoint_problem(path: Path) -> str | None:
    """Why ``path`` is not a readable Lightning checkpoint, or None; reads the archive's index
    and pickle bytes only, never unpickles them."""
    if not zipfile.is_zipfile(path):
        return "not a zip archive (torch.save's format): truncated (an interrupted save?) or not a checkpoint"
    try:
        with zipfile.ZipFile(path) as archive:
            pickles = [n for n in archive.namelist() if n == "data.pkl" or n.endswith("/data.pkl")]
            if not pickles:
                return "a zip archive but not a torch.save file (no data.pkl)"
            head = archive.read(pickles[0])
    except (OSError, zipfile.BadZipFile, EOFError) as err:
        return f"unreadable ({err}): truncated or corrupted"
    if b"pytorch-lightning_version" not in head:
        return "a torch file but not a Lightning checkpoint (no pytorch-lightning_version)"
    return None


def check_checkpoint(field: str, path: str) -> None:
    """``path`` is a Lightning checkpoint file; else the error suggests an earlier one beside it."""
    p = Path(path)  # as Lightning will open it: no ~ expansion
    check(p.is_file(), field, path, "an existing Lightning checkpoint file")
    problem = checkpoint_problem(p)
    if problem is None:
        return
    earlier = sorted(
        (c for c in p.parent.glob("*.ckpt") if c.is_file() and c.resolve() != p.resolve()),
        key=lambda c: c.stat().st_mtime,
        reverse=True,
    )
    good = next((c for c in earlier if checkpoint_problem(c) is None), None)
    hint = (
        f"resume from the newest readable one beside it: ckpt_path={good}"
        if good
        else f"no readable .ckpt next to it in {p.parent}"
    )
    raise ConfigError(field, path, f"{problem}; {hint}")


def check_env_target(target: str, kwargs: Any = None) -> None:
    """``env._target_`` names a TextEnv class; checked without calling it, with ``env.kwargs``
    checked against the types its constructor declares."""
    from rlhf_lightning.envs.factory import env_class

    cls = env_class(target)
    if kwargs:
        check_constructor_kwargs(cls, kwargs, "env.kwargs")


def validate(cfg: DictConfig) -> None:
    """Check the composed config; raises :class:`ConfigError` on the first invalid value."""
    early_checks(cfg)  # what train.py already ran before the heavy imports (cheap; the API needs it)
    typed_before = is_typed(cfg.algo)
    check_configured_callbacks(cfg.get("callbacks"))
    spec = typed_algo(cfg)
    resolve_algo(cfg.algo)
    validate_model(cfg.model)
    a = cfg.algo
    if not typed_before:  # a family's own YAML: its optimiser fields exist only now
        validate_optim(a)
    spec.validate(a, cfg)
    validate_reference(a, cfg, spec)
    if spec.data == "online" and cfg.model.finetune == "lora":
        check(
            cfg.model.lora.dropout == 0.0,
            "model.lora.dropout",
            cfg.model.lora.dropout,
            f"0 for algo.module={a.module}: dropout makes the trainer's log-probs differ from the "
            "sampler's (on-policy ratios != 1); LoRA dropout applies to SFT and DPO only",
        )
    check(
        spec.data == "online" or list(cfg.reward.sources) == ["env"],
        "reward.sources",
        list(cfg.reward.sources),
        f"[env] for algo.module={a.module}: rewards score rollouts, and {a.module} trains on a dataset",
    )
    from rlhf_lightning.population.checks import validate_population

    validate_population(cfg.population, spec, cfg)
    if cfg.rollout.mode == "async":
        validate_async(cfg, spec.data)
    validate_reward_and_env(cfg)
    check(cfg.logger.name in LOGGERS, "logger.name", cfg.logger.name, f"one of {', '.join(LOGGERS)}")
    validate_strategy(cfg)
    validate_run_fields(cfg)


def validate_async(cfg: DictConfig, data: str) -> None:
    """``rollout.mode=async``: what the producer process supports (docs/guides/async.md)."""
    check(
        data == "online",
        "rollout.mode",
        "async",
        f"sync for algo.module={cfg.algo.module}: it trains on a dataset, there are no rollouts to overlap",
    )
    check(
        not cfg.rollout.get("offload_trainer_during_rollout", False),
        "rollout.offload_trainer_during_rollout",
        True,
        "false with rollout.mode=async (the trainer keeps training while the producer generates)",
    )
    validate_producer_devices(cfg)
    check(
        cfg.strategy.name in ("auto", "ddp"),
        "strategy",
        cfg.strategy.name,
        "auto or ddp with rollout.mode=async (every rank runs its own producer with full weights)",
    )
    check(
        cfg.population.size == 1,
        "population.size",
        cfg.population.size,
        "1 with rollout.mode=async (members swap into the one policy between steps)",
    )
    loss = registered_name(cfg.algo.loss) if cfg.algo.get("loss") is not None else None
    check(
        loss is None or cfg.rollout.max_staleness == 0 or POLICY_LOSSES.meta(loss).get("uses_ratio", True),
        "algo.loss",
        loss,
        f"an objective with an importance ratio (ppo_clip, cispo, gspo) with rollout.max_staleness="
        f"{cfg.rollout.max_staleness}: {loss} would follow stale samples uncorrected",
    )


def validate_reward_and_env(cfg: DictConfig) -> None:
    """The ``reward`` sources' required fields and the ``env`` node (its class, turns,
    concurrency, timeouts, model length)."""
    rw = cfg.reward
    check(
        "function" not in rw.sources or rw.fn is not None,
        "reward.fn",
        rw.fn,
        "required with reward=function: pass reward.fn=my_pkg.rewards.my_fn",
    )
    check(
        "model" not in rw.sources or rw.model_path is not None,
        "reward.model_path",
        rw.model_path,
        "required with reward=model: pass reward.model_path=/path/to/reward_model",
    )
    e = cfg.env
    check_env_target(e._target_, e.kwargs)
    check(e.max_turns >= 1, "env.max_turns", e.max_turns, "at least 1")
    check(
        e.concurrency >= 1, "env.concurrency", e.concurrency, "at least 1 (1: env steps one after the other)"
    )
    check(
        e.step_timeout_s is None or e.step_timeout_s > 0,
        "env.step_timeout_s",
        e.step_timeout_s,
        "> 0 seconds, or null (no limit)",
    )
    check(
        e.step_workers in STEP_WORKERS,
        "env.step_workers",
        e.step_workers,
        f"one of {', '.join(STEP_WORKERS)}",
    )
    check(  # env=openenv bounds its own calls with env.step_timeout_s (config/sections.check_openenv)
        e.step_workers == "process" or e.step_timeout_s is None or e.get("_target_") == OPENENV_TARGET,
        "env.step_timeout_s",
        e.step_timeout_s,
        "null with env.step_workers=thread (a thread cannot be stopped); or set env.step_workers=process",
    )
    check(
        e.on_reward_error in ("raise", "zero"), "env.on_reward_error", e.on_reward_error, "one of raise, zero"
    )
    check(e.history_k >= 1, "env.history_k", e.history_k, "at least 1 (turns kept by env.history=last_k)")
    check(cfg.eval.num_samples >= 1, "eval.num_samples", cfg.eval.num_samples, "at least 1")
    check(
        e.max_model_len > cfg.rollout.max_new_tokens,
        "env.max_model_len",
        e.max_model_len,
        f"more than rollout.max_new_tokens ({cfg.rollout.max_new_tokens})",
    )


def validate_run_fields(cfg: DictConfig) -> None:
    """The run's own fields: threads, seed, progress, the optimized metric, eval and checkpoints."""
    check(cfg.num_threads is None or cfg.num_threads > 0, "num_threads", cfg.num_threads, "> 0, or null")
    check(
        0 <= cfg.seed < 2**32,
        "seed",
        cfg.seed,
        "an integer in [0, 2**32 - 1] (NumPy's and every rank's seed range)",
    )
    every = cfg.progress.every_n_steps
    check(
        every is None or every >= 0, "progress.every_n_steps", every, ">= 0 (0: no progress lines), or null"
    )
    check(cfg.optimized_mode in ("final", "best"), "optimized_mode", cfg.optimized_mode, "final or best")
    check(
        cfg.optimized_direction in ("maximize", "minimize"),
        "optimized_direction",
        cfg.optimized_direction,
        "maximize or minimize",
    )
    check(cfg.eval.batch_size > 0, "eval.batch_size", cfg.eval.batch_size, "> 0")
    check(
        all(isinstance(k, str) and k for k in cfg.eval.info_metrics),
        "eval.info_metrics",
        list(cfg.eval.info_metrics),
        "a list of info keys, e.g. [valid_move]",
    )
    check(cfg.checkpoint.every_n_steps >= 0, "checkpoint.every_n_steps", cfg.checkpoint.every_n_steps, ">= 0")
    if cfg.ckpt_path is not None:
        check_checkpoint("ckpt_path", cfg.ckpt_path)


def trainer_cuda_devices(devices: Any, visible: int) -> list[int]:
    """The CUDA devices ``trainer.devices`` trains on, of ``visible``: a count takes the first
    ones, a list names them, ``auto`` (or -1) takes them all."""
    if isinstance(devices, int) and devices > 0:
        return list(range(devices))
    if isinstance(devices, (list, tuple)) or OmegaConf.is_list(devices):
        return [int(d) for d in devices]
    return list(range(visible))


def validate_producer_devices(cfg: DictConfig, visible: int | None = None) -> None:
    """``rollout.devices``: CUDA devices that exist here, that training does not use, one per rank.
    ``visible``: the CUDA device count (default: torch's)."""
    devices = cfg.rollout.devices
    if devices is None:
        return
    if visible is None:
        import torch

        visible = torch.cuda.device_count()
    wanted = [int(d) for d in devices]
    check(
        cfg.trainer.num_nodes == 1,
        "trainer.num_nodes",
        cfg.trainer.num_nodes,
        "1 with rollout.devices (the producers' devices are indexed by rank on one machine)",
    )
    check(
        visible > 0,
        "rollout.devices",
        wanted,
        "null on a machine without CUDA devices (the producer then runs beside the trainer, on the CPU)",
    )
    check(max(wanted) < visible, "rollout.devices", wanted, f"indices below {visible}, the CUDA devices here")
    used = trainer_cuda_devices(cfg.trainer.devices, visible)
    check(
        not set(wanted) & set(used),
        "rollout.devices",
        wanted,
        f"devices training does not use: trainer.devices={cfg.trainer.devices} trains on {used} "
        f"(e.g. trainer.devices=[0] rollout.devices=[1])",
    )
    check(
        len(wanted) >= len(used),
        "rollout.devices",
        wanted,
        f"one device per rank: {len(used)} ranks train on {used}",
    )
