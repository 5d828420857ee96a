"""The start-up checks that need nothing but the composed config: no torch, Lightning or
transformers import, so ``train.py`` runs them before it imports the run and a bad value of a
common field fails in well under a second (``bench/startup.py``). ``validation.validate`` runs
them again with the rest (the family's own checks, kernels, envs, rewards, population).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rlhf_lightning.config.algo import (
    BUILTIN_AGGREGATION_MODES,
    BUILTIN_KL_ESTIMATORS,
    BUILTIN_OUTCOME_ADVANTAGES,
    BUILTIN_POLICY_LOSSES,
    registered_name,
)
from rlhf_lightning.config.errors import ConfigError, check, check_model_path
from rlhf_lightning.config.sections import check_sections, validate_precision
from rlhf_lightning.config.server_args import PROCESSED_LOGPROBS, logprobs_modes

DTYPES = ("auto", "float32", "bfloat16", "float16")
LOGGERS = ("csv", "tensorboard", "wandb")
# What to pass for a required (``???``) field; any other one gets ``<value>``.
REQUIRED_EXAMPLES = {"model.path": "/path/to/model", "env._target_": "my_pkg.envs.MyEnv"}


def check_required(cfg: DictConfig) -> None:
    """Fields left at ``???`` (e.g. ``model.path`` of ``model=local``) are named, not a traceback."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        key = missing[0]
        raise ConfigError(
            key,
            "???",
            f"required and not set: pass {key}={REQUIRED_EXAMPLES.get(key, '<value>')} on the command line",
        )


def validate_model_fields(m: DictConfig) -> None:
    """``model.*`` as far as the config alone tells (quantization and kernels: run/validation.py)."""
    check_model_path("model.path", m.path)
    if m.tokenizer_path is not None:
        check_model_path("model.tokenizer_path", m.tokenizer_path)
    template = m.chat_template
    check(
        template is None
        or not str(template).strip().endswith(".jinja")
        or Path(str(template).strip()).expanduser().is_file(),
        "model.chat_template",
        template,
        "an existing .jinja file, or a Jinja template string",
    )
    check(m.dtype in DTYPES, "model.dtype", m.dtype, f"one of {', '.join(DTYPES)}")
    check(m.finetune in ("lora", "full"), "model.finetune", m.finetune, "one of lora, full")
    check(
        m.compute_dtype in DTYPES[1:],
        "model.compute_dtype",
        m.compute_dtype,
        f"one of {', '.join(DTYPES[1:])}",
    )
    if m.finetune == "lora":
        check(m.lora.r > 0, "model.lora.r", m.lora.r, "a positive rank")
        check(m.lora.alpha > 0, "model.lora.alpha", m.lora.alpha, "a positive number")
        check(0.0 <= m.lora.dropout < 1.0, "model.lora.dropout", m.lora.dropout, "a probability in [0, 1)")


def validate_optim(a: DictConfig) -> None:
    check(a.lr > 0, "algo.lr", a.lr, "a learning rate > 0")
    check(a.weight_decay >= 0, "algo.weight_decay", a.weight_decay, ">= 0")
    check(a.warmup_steps >= 0, "algo.warmup_steps", a.warmup_steps, ">= 0")
    check(0.0 <= a.min_lr_ratio <= 1.0, "algo.min_lr_ratio", a.min_lr_ratio, "in [0, 1]")
    check(
        a.grad_clip is None or a.grad_clip > 0, "algo.grad_clip", a.grad_clip, "> 0, or null for no clipping"
    )
    check(
        a.chunk_rows is None or a.chunk_rows > 0,
        "algo.chunk_rows",
        a.chunk_rows,
        "a positive int, or null (auto)",
    )
    check(
        len(a.adam_betas) == 2 and all(0.0 <= b < 1.0 for b in a.adam_betas),
        "algo.adam_betas",
        list(a.adam_betas),
        "two numbers [beta1, beta2], each in [0, 1) (e.g. [0.9, 0.999])",
    )
    check(a.adam_eps > 0, "algo.adam_eps", a.adam_eps, "> 0 (e.g. 1e-8)")
    check(
        a.micro_batch_size is None or a.micro_batch_size > 0,
        "algo.micro_batch_size",
        a.micro_batch_size,
        "a positive number of examples, or null",
    )
    check(
        a.ref_update_interval is None or a.ref_update_interval > 0,
        "algo.ref_update_interval",
        a.ref_update_interval,
        "a positive number of optimizer steps, or null",
    )


def validate_rollout(r: DictConfig) -> None:
    check(
        r.engine in ("hf", "vllm", "vllm_server"), "rollout.engine", r.engine, "one of hf, vllm, vllm_server"
    )
    if r.engine == "vllm_server":
        validate_server_fields(r)
    if r.engine == "vllm":
        check(r.sleep_mode_level in (1, 2), "rollout.sleep_mode_level", r.sleep_mode_level, "1 or 2")
        check(
            0.0 < r.gpu_memory_utilization <= 1.0,
            "rollout.gpu_memory_utilization",
            r.gpu_memory_utilization,
            "a share in (0, 1]",
        )
        check(
            r.kv_cache_memory_bytes is None or r.kv_cache_memory_bytes > 0,
            "rollout.kv_cache_memory_bytes",
            r.kv_cache_memory_bytes,
            "> 0 bytes, or null",
        )
    check(r.max_new_tokens > 0, "rollout.max_new_tokens", r.max_new_tokens, "a positive number of tokens")
    check(
        r.temperature > 0,
        "rollout.temperature",
        r.temperature,
        "> 0 (training samples; eval runs greedy too)",
    )
    check(0.0 < r.top_p <= 1.0, "rollout.top_p", r.top_p, "in (0, 1]")
    check(r.top_k >= 0, "rollout.top_k", r.top_k, ">= 0 (0 disables top-k)")
    check(
        r.repetition_penalty > 0,
        "rollout.repetition_penalty",
        r.repetition_penalty,
        "> 0 (1.0 disables it)",
    )
    check(0.0 <= r.min_p < 1.0, "rollout.min_p", r.min_p, "in [0, 1) (0 disables it)")
    check(
        all(isinstance(s, str) and s for s in r.stop),
        "rollout.stop",
        list(r.stop),
        "a list of non-empty stop strings",
    )
    check(
        r.max_batch_size is None or r.max_batch_size > 0,
        "rollout.max_batch_size",
        r.max_batch_size,
        "> 0 or null",
    )
    validate_async_fields(r)


def validate_server_fields(r: DictConfig) -> None:
    """``rollout=vllm_server``'s own fields (docs/guides/inference-servers.md)."""
    servers = None if r.servers is None else list(r.servers)
    check(
        servers is None
        or (
            len(servers) > 0
            and all(isinstance(u, str) and u.startswith(("http://", "https://")) for u in servers)
        ),
        "rollout.servers",
        servers,
        "null (the run starts its servers) or a list of URLs such as [http://10.0.0.5:8000]",
    )
    devices = None if r.server_devices is None else list(r.server_devices)
    check(
        devices is None or (len(devices) > 0 and all(isinstance(d, str) and d for d in devices)),
        "rollout.server_devices",
        devices,
        "null (one server) or one CUDA_VISIBLE_DEVICES string per server, e.g. ['0', '1'] or ['0,1']",
    )
    check(
        servers is None or devices is None,
        "rollout.server_devices",
        devices,
        "null with rollout.servers (the run starts no server when it is given URLs)",
    )
    for name in ("max_concurrency", "request_timeout_s", "server_start_timeout_s", "max_loras"):
        check(r[name] > 0, f"rollout.{name}", r[name], "> 0")
    check(r.request_retries >= 0, "rollout.request_retries", r.request_retries, ">= 0")
    args = [str(a) for a in r.server_args]
    check(
        all(m == PROCESSED_LOGPROBS for m in logprobs_modes(args)),
        "rollout.server_args",
        args,
        "no --logprobs-mode but processed_logprobs (the log-probs the ratio needs: after temperature "
        "and the top-k/top-p/min-p filters); the run starts its servers with it",
    )


def validate_async_fields(r: DictConfig) -> None:
    """``rollout.mode`` and the asynchronous rollouts' own fields."""
    check(r.mode in ("sync", "async"), "rollout.mode", r.mode, "sync or async")
    check(r.max_staleness >= 0, "rollout.max_staleness", r.max_staleness, ">= 0 versions (0: lockstep)")
    check(
        not r.partial or r.mode == "async",
        "rollout.partial",
        r.partial,
        "false with rollout.mode=sync (partial rollouts continue episodes under newer weights: async only)",
    )
    check(
        r.partial_versions in ("newest", "planned"),
        "rollout.partial_versions",
        r.partial_versions,
        "newest (each turn the newest published weights) or planned (turn j: j versions newer, waiting for them)",
    )
    check(
        r.producer_threads is None or r.producer_threads >= 1,
        "rollout.producer_threads",
        r.producer_threads,
        ">= 1, or null (the trainer's)",
    )
    check(r.async_timeout_s > 0, "rollout.async_timeout_s", r.async_timeout_s, "> 0 seconds")
    devices = None if r.devices is None else list(r.devices)
    check(
        devices is None or (r.mode == "async" and len(devices) > 0 and all(d >= 0 for d in devices)),
        "rollout.devices",
        devices,
        "null, or with rollout.mode=async a list of CUDA device indices, one per rank (e.g. [1])",
    )
    check(
        devices is None or len(set(devices)) == len(devices),
        "rollout.devices",
        devices,
        "one device per rank's producer, none repeated",
    )


def validate_trainer(t: DictConfig) -> None:
    check(
        t.max_steps > 0 or (t.max_steps == -1 and t.max_epochs is not None and t.max_epochs > 0),
        "trainer.max_steps",
        t.max_steps,
        "a positive number of optimizer steps, or -1 together with trainer.max_epochs > 0 (a run needs an end)",
    )
    v = t.val_check_interval
    check(
        v is None
        or (isinstance(v, int) and not isinstance(v, bool) and v > 0)
        or (isinstance(v, float) and 0.0 < v <= 1.0),
        "trainer.val_check_interval",
        v,
        "a positive number of training steps, a fraction of an epoch in (0, 1], or null",
    )
    validate_precision(t.precision)


def check_known_keys(node: Any, prefix: str = "") -> None:
    """Keys added with ``+group.key=...`` that the group's schema does not define are typos."""
    if not isinstance(node, DictConfig):
        return
    schema = OmegaConf.get_type(node)
    if schema is not None and dataclasses.is_dataclass(schema):
        known = {f.name for f in dataclasses.fields(schema)}
        for key in node:
            if key not in known:
                raise ConfigError(
                    f"{prefix}{key!s}",
                    node[key],
                    f"not a field of {prefix.rstrip('.') or 'the config'}; valid: {', '.join(sorted(known))}",
                )
    for key in node:
        if isinstance(key, str) and key != "kwargs":
            check_known_keys(node._get_node(key), f"{prefix}{key}.")


def early_checks(cfg: DictConfig) -> None:
    """What can be checked before the heavy imports: required fields, unknown keys, and the
    values of ``model``, ``rollout``, ``trainer``, (when its YAML starts from a schema)
    ``algo``'s optimiser fields, and the run's own sections (``config/sections.py``). Raises
    :class:`ConfigError`."""
    check_required(cfg)
    check_known_keys(cfg)
    validate_model_fields(cfg.model)
    validate_rollout(cfg.rollout)
    validate_trainer(cfg.trainer)
    if is_typed(cfg.algo):  # a family's own YAML: validation.validate, once typed
        validate_optim(cfg.algo)
    if cfg.algo.get("module") in ("grpo", "ppo"):  # a family outside may register names of its own
        validate_rollout_names(cfg.algo)
    check_family(cfg)
    check_sections(cfg)


BUILTIN_FAMILIES = ("grpo", "ppo", "dpo", "sft")  # conf/family/ (and none)


def check_family(cfg: DictConfig) -> None:
    """The tuned settings' family agrees with the algorithm's module: an option built on
    ``algo/grpo.yaml`` but switched to ``module: ppo`` would otherwise get GRPO's tuned values."""
    family, module = cfg.get("family", "none"), cfg.algo.get("module")
    check(
        family == "none" or module not in BUILTIN_FAMILIES or family == module,
        "family",
        family,
        f"the family of algo.module={module}: add `- override /family@_global_.family: {module}` to the "
        f"algorithm option's defaults (after the option it builds on), or family={module} on the command line",
    )


def validate_rollout_names(a: DictConfig) -> None:
    """The built-in rollout families' choices by name: loss (a built-in name or a dotted path,
    imported later), advantage estimator, aggregation, KL estimator and mode, the behaviour
    log-probs' source. The family's checks run them again with the registries."""
    one_of = ", ".join
    if a.module == "grpo":
        loss, advantage = registered_name(a.loss), registered_name(a.advantage)
        check(
            loss in BUILTIN_POLICY_LOSSES or "." in loss,
            "algo.loss",
            loss,
            f"one of {one_of(BUILTIN_POLICY_LOSSES)}, or the dotted path of a loss a module registers",
        )
        check(
            advantage in BUILTIN_OUTCOME_ADVANTAGES or "." in advantage,
            "algo.advantage",
            advantage,
            f"one of {one_of(BUILTIN_OUTCOME_ADVANTAGES)} (gae needs a critic: use algo=ppo), or the "
            "dotted path of an outcome estimator a module registers",
        )
    for field, value, allowed in (
        ("loss_agg_mode", a.loss_agg_mode, BUILTIN_AGGREGATION_MODES),
        ("kl_estimator", a.kl_estimator, BUILTIN_KL_ESTIMATORS),
        ("kl_mode", a.kl_mode, ("loss", "reward", "advantage")),
        ("old_logprobs_source", a.old_logprobs_source, ("trainer", "rollout")),
    ):
        check(value in allowed, f"algo.{field}", value, f"one of {one_of(allowed)}")


def is_typed(node: Any) -> bool:
    """Whether ``node`` is a structured config (its YAML starts from a schema)."""
    schema = OmegaConf.get_type(node)
    return schema is not None and dataclasses.is_dataclass(schema)
