"""Each algorithm family's own start-up checks (referenced by its ``AlgorithmSpec``): one
message naming the field, the value and what is allowed, before any model is loaded."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from omegaconf import DictConfig, open_dict

from rlhf_lightning.config.algo import node_params, registered_name
from rlhf_lightning.config.errors import check
from rlhf_lightning.learner.liger_path import liger_unsupported
from rlhf_lightning.losses import ADVANTAGE_ESTIMATORS, AGGREGATION_MODES, KL_ESTIMATORS, POLICY_LOSSES

CLIP_FIELDS = ("clip_low", "clip_high")


def resolve_algo(a: DictConfig) -> None:
    """The algorithm config as the code reads it: :func:`normalise_nodes`, then
    :func:`resolve_clip_defaults`. Idempotent."""
    normalise_nodes(a)
    resolve_clip_defaults(a)


def normalise_nodes(a: DictConfig) -> None:
    """``algo.loss`` and ``algo.advantage`` as ``{name, <params>}`` nodes, whatever the spelling.

    A flat name (``algo.loss=cispo``) becomes ``{name: cispo}``; ``algo.loss_kwargs`` (the older
    spelling) joins the loss node (the node's own value wins). A known function's node keys must
    be its parameters (a field of the loss's params class; one of the estimator's ``params``),
    named here with the field they came from. A parameter the flat config also has (the loss's
    ``clip_high``, the estimator's ``scale`` as ``advantage_scale``) moves into that field, which
    the built-in code, the population and the Liger path read; the rest (a function defined
    outside the package) stays in the node, where :class:`~rlhf_lightning.learner.objective.
    PolicyTerm` and the GRPO module bind it. Idempotent; an unknown name is left for the family's
    check to name."""
    if "loss" in a:
        name, params = registered_name(a.loss), node_params(a.loss)
        kwargs = dict(a.get("loss_kwargs") or {})
        if name in POLICY_LOSSES:
            cls = POLICY_LOSSES.meta(name)["params"]
            known = {f.name for f in dataclasses.fields(cls)}
            for where, values in (("loss", params), ("loss_kwargs", kwargs)):
                for key, value in values.items():
                    check(
                        key in known,
                        f"algo.{where}.{key}",
                        value,
                        f"a field of {cls.__name__}, the params of algo.loss={name} "
                        f"({', '.join(sorted(known)) or 'none'})",
                    )
        params = {**kwargs, **params}
        with open_dict(a):
            for key in [k for k in params if k in a and k not in ("name", "loss", "advantage")]:
                a[key] = params.pop(key)
            a.loss = {"name": name, **params}
            if "loss_kwargs" in a:
                a.loss_kwargs = {}
    if "advantage" in a:
        name, params = registered_name(a.advantage), node_params(a.advantage)
        if name in ADVANTAGE_ESTIMATORS:
            accepted = tuple(ADVANTAGE_ESTIMATORS.meta(name).get("params", ()))
            for key, value in params.items():
                check(
                    key in accepted,
                    f"algo.advantage.{key}",
                    value,
                    f"a parameter of the {name} estimator ({', '.join(accepted) or 'none'})",
                )
        with open_dict(a):
            for key in [k for k in params if f"advantage_{k}" in a]:
                a[f"advantage_{key}"] = params.pop(key)
            a.advantage = {"name": name, **params}


def resolve_clip_defaults(a: DictConfig) -> None:
    """``algo.clip_low`` / ``algo.clip_high`` left at ``auto`` (the schema's default) take the chosen
    loss's own values, from its params class in :mod:`rlhf_lightning.losses.policy` (ppo_clip 0.2 /
    0.2, cispo none / 4.0, gspo 3e-4 / 4e-4; a loss without clip bounds: none). So ``algo=grpo
    algo.loss=gspo`` clips as GSPO does, and an explicit number (or null: no bound) is kept.
    PPO's loss is ppo_clip. Idempotent; an unknown loss is left for the start-up check to name."""
    if not all(k in a for k in CLIP_FIELDS):
        return  # an offline family
    name = registered_name(a.get("loss", "ppo_clip"))
    if name not in POLICY_LOSSES:
        return
    params = POLICY_LOSSES.meta(name)["params"]
    defaults = {f.name: f.default for f in dataclasses.fields(params)}
    with open_dict(a):
        for key in CLIP_FIELDS:
            if a[key] == "auto":
                a[key] = defaults.get(key)


def validate_ppo(a: DictConfig, cfg: DictConfig) -> None:
    validate_rollout_algo(a, cfg)
    check(
        cfg.model.finetune == "lora",
        "model.finetune",
        cfg.model.finetune,
        "lora for algo=ppo: the critic is a LoRA adapter on the shared frozen base",
    )
    check(0.0 < a.gamma <= 1.0, "algo.gamma", a.gamma, "a discount in (0, 1]")
    check(0.0 <= a.gae_lambda <= 1.0, "algo.gae_lambda", a.gae_lambda, "in [0, 1]")
    check(
        a.advantage_granularity in ("turn", "token", "auto"),
        "algo.advantage_granularity",
        a.advantage_granularity,
        "one of turn, token, auto",
    )
    check(
        a.turn_value_reduction in ("state", "mean", "final_value"),
        "algo.turn_value_reduction",
        a.turn_value_reduction,
        "one of state (V before the turn's first token), mean, final_value",
    )
    check(
        a.importance_sampling_level in ("token", "turn", "trajectory", "auto"),
        "algo.importance_sampling_level",
        a.importance_sampling_level,
        "one of token, turn, trajectory, auto",
    )
    check(a.vf_coef >= 0, "algo.vf_coef", a.vf_coef, ">= 0")
    check(a.value_clip is None or a.value_clip > 0, "algo.value_clip", a.value_clip, "> 0, or null")
    check(a.lr_critic is None or a.lr_critic > 0, "algo.lr_critic", a.lr_critic, "> 0, or null (= algo.lr)")
    check(a.critic_warmup_steps >= 0, "algo.critic_warmup_steps", a.critic_warmup_steps, ">= 0")
    check(a.entropy_coef >= 0, "algo.entropy_coef", a.entropy_coef, ">= 0")


def validate_offline(a: DictConfig, cfg: DictConfig) -> None:
    check(
        a.data_path is not None and Path(a.data_path).expanduser().is_file(),
        "algo.data_path",
        a.data_path,
        "an existing .jsonl, .json or .parquet file",
    )
    check(
        a.eval_data_path is None or Path(a.eval_data_path).expanduser().is_file(),
        "algo.eval_data_path",
        a.eval_data_path,
        "an existing file, or null (use the last eval_fraction of data_path)",
    )
    check(0.0 < a.eval_fraction < 1.0, "algo.eval_fraction", a.eval_fraction, "in (0, 1)")
    check(a.batch_size >= 1, "algo.batch_size", a.batch_size, "at least 1")
    check(a.max_len > 1, "algo.max_len", a.max_len, "more than 1 token")


def validate_dpo(a: DictConfig, cfg: DictConfig) -> None:
    validate_offline(a, cfg)
    check(a.beta > 0, "algo.beta", a.beta, "> 0 (the DPO temperature)")
    check(a.loss_type in ("sigmoid", "ipo"), "algo.loss_type", a.loss_type, "one of sigmoid, ipo")
    check(0.0 <= a.label_smoothing < 0.5, "algo.label_smoothing", a.label_smoothing, "in [0, 0.5)")


def validate_rollout_algo(a: DictConfig, cfg: DictConfig) -> None:
    """What every rollout algorithm shares (batch geometry, clipping, KL, corrections, Liger),
    checked in that order (the first bad field is the one named)."""
    check_names_and_batches(a)
    check_clipping(a)
    check_shaping_and_corrections(a, cfg.rollout.max_new_tokens)
    check_distillation(a)
    if a.use_liger_loss:
        reason = liger_unsupported(a)
        check(
            reason is None,
            "algo.use_liger_loss",
            True,
            f"Liger's fused loss does not cover {reason}; set algo.use_liger_loss=false",
        )


DISTILL_ESTIMATORS = ("sampled", "full")


def check_distillation(a: DictConfig) -> None:
    """``algo.teacher`` / ``algo.distill``: pure distillation needs its teacher (its model and
    tokenizer are checked when the run is built, before the student loads)."""
    teacher, distill = a.get("teacher"), a.get("distill")
    if teacher is None or distill is None:
        return
    check(
        teacher.path is not None or distill.task_reward,
        "algo.teacher.path",
        teacher.path,
        "a model directory or Hub id with the student's tokenizer: algo.distill.task_reward=false "
        "(algo=distill) learns from the teacher alone",
    )
    check(
        teacher.path is None or distill.coef >= 0,
        "algo.distill.coef",
        distill.coef,
        ">= 0 (the weight of the reverse KL to the teacher)",
    )
    check(
        distill.get("estimator", "sampled") in DISTILL_ESTIMATORS,
        "algo.distill.estimator",
        distill.get("estimator"),
        f"one of {', '.join(DISTILL_ESTIMATORS)} (sampled: the sampled token's log-ratio in the advantages; "
        "full: the exact KL over the vocabulary as a loss term)",
    )


def check_names_and_batches(a: DictConfig) -> None:
    """The aggregation and KL estimator names, and the batch geometry: group, prompts,
    mini- and micro-batches (rows or tokens), epochs."""
    check(
        a.loss_agg_mode in AGGREGATION_MODES,
        "algo.loss_agg_mode",
        a.loss_agg_mode,
        f"one of {', '.join(AGGREGATION_MODES)}",
    )
    check(
        a.kl_estimator in KL_ESTIMATORS,
        "algo.kl_estimator",
        a.kl_estimator,
        f"one of {', '.join(KL_ESTIMATORS)}",
    )
    check(
        a.group_size >= 2,
        "algo.group_size",
        a.group_size,
        "at least 2: group-relative advantages compare completions of the same prompt",
    )
    check(a.prompts_per_step >= 1, "algo.prompts_per_step", a.prompts_per_step, "at least 1")
    rollout_batch = a.prompts_per_step * a.group_size
    mini = a.mini_batch_size or rollout_batch
    check(
        1 <= mini <= rollout_batch and rollout_batch % mini == 0,
        "algo.mini_batch_size",
        a.mini_batch_size,
        f"a divisor of the rollout batch prompts_per_step x group_size = {rollout_batch}",
    )
    micro = a.micro_batch_size or mini
    check(
        1 <= micro <= mini and mini % micro == 0,
        "algo.micro_batch_size",
        a.micro_batch_size,
        f"a divisor of the mini-batch ({mini} trajectories)",
    )
    tokens = a.micro_batch_tokens
    check(
        tokens is None or (isinstance(tokens, int) and tokens > 0),
        "algo.micro_batch_tokens",
        tokens,
        "a positive token budget per micro-batch, or null (micro_batch_size rows)",
    )
    check(
        tokens is None or a.micro_batch_size is None,
        "algo.micro_batch_size",
        a.micro_batch_size,
        f"null with algo.micro_batch_tokens={tokens}: set one of the two",
    )
    check(a.update_epochs >= 1, "algo.update_epochs", a.update_epochs, "at least 1")


def check_clipping(a: DictConfig) -> None:
    """The KL coefficient and clamp, and the ratio's clip bounds (numbers, null or auto)."""
    check(a.beta >= 0, "algo.beta", a.beta, "a KL coefficient >= 0")
    check(a.kl_clamp is None or a.kl_clamp > 0, "algo.kl_clamp", a.kl_clamp, "> 0, or null")
    for key in CLIP_FIELDS:
        value = a[key]
        check(
            value is None
            or value == "auto"  # only while algo.loss is unknown (named by its own check)
            or (isinstance(value, int | float) and not isinstance(value, bool)),
            f"algo.{key}",
            value,
            "a number, null (no bound) or auto (the loss's own bound)",
        )
    check(
        a.clip_low in (None, "auto") or 0.0 <= a.clip_low < 1.0,
        "algo.clip_low",
        a.clip_low,
        "an offset in [0, 1) (the ratio's lower bound is 1 - clip_low), or null for none",
    )
    check(
        a.clip_high in (None, "auto") or a.clip_high > 0.0,
        "algo.clip_high",
        a.clip_high,
        "an offset > 0 (the ratio's upper bound is 1 + clip_high), or null for none",
    )
    check(
        a.clip_ratio_c is None or a.clip_ratio_c > 1.0,
        "algo.clip_ratio_c",
        a.clip_ratio_c,
        "a dual-clip bound > 1, or null",
    )


def check_shaping_and_corrections(a: DictConfig, max_new_tokens: int) -> None:
    """Length normalisation, pooling, the overlong penalty, the KL's place, the behaviour
    log-probs' source and the importance corrections and off-policy masks."""
    check(
        a.max_len_norm is None or a.max_len_norm > 0,
        "algo.max_len_norm",
        a.max_len_norm,
        "a positive token count, or null (rollout.max_new_tokens)",
    )
    check(a.is_pooling in ("mean", "sum"), "algo.is_pooling", a.is_pooling, "one of mean, sum")
    check(
        a.overlong_buffer is None or 0 < a.overlong_buffer <= max_new_tokens,
        "algo.overlong_buffer",
        a.overlong_buffer,
        f"a token count in [1, rollout.max_new_tokens={max_new_tokens}], or null",
    )
    check(a.overlong_penalty_factor >= 0, "algo.overlong_penalty_factor", a.overlong_penalty_factor, ">= 0")
    check(
        a.kl_mode in ("loss", "reward", "advantage"),
        "algo.kl_mode",
        a.kl_mode,
        "one of loss, reward, advantage",
    )
    check(
        a.old_logprobs_source in ("trainer", "rollout"),
        "algo.old_logprobs_source",
        a.old_logprobs_source,
        "one of trainer, rollout",
    )
    check(
        a.tis_cap is None or a.tis_cap >= 1.0,
        "algo.tis_cap",
        a.tis_cap,
        ">= 1 (a cap on importance weights), or null",
    )
    bounds = a.offpolicy_token_bounds
    check(
        bounds is None or (len(bounds) == 2 and 0 <= bounds[0] < 1 < bounds[1]),
        "algo.offpolicy_token_bounds",
        None if bounds is None else list(bounds),
        "[low, high] with 0 <= low < 1 < high, or null",
    )
    check(
        a.offpolicy_seq_threshold is None or a.offpolicy_seq_threshold > 0,
        "algo.offpolicy_seq_threshold",
        a.offpolicy_seq_threshold,
        "> 0 nats, or null",
    )


def validate_grpo(a: DictConfig, cfg: DictConfig) -> None:
    validate_rollout_algo(a, cfg)
    loss, advantage = registered_name(a.loss), registered_name(a.advantage)
    check(
        loss in POLICY_LOSSES,
        "algo.loss",
        loss,
        f"one of {', '.join(POLICY_LOSSES.names())}, or the dotted path of a loss a module registers",
    )
    outcome = [
        n for n in ADVANTAGE_ESTIMATORS.names() if ADVANTAGE_ESTIMATORS.meta(n).get("kind") == "outcome"
    ]
    check(
        advantage in ADVANTAGE_ESTIMATORS and ADVANTAGE_ESTIMATORS.meta(advantage).get("kind") == "outcome",
        "algo.advantage",
        advantage,
        f"one of {', '.join(outcome)} (gae needs a critic: use algo=ppo), or the dotted path of an "
        "outcome estimator a module registers",
    )
    check(
        a.advantage_scale in ("group", "batch", "none"),
        "algo.advantage_scale",
        a.advantage_scale,
        "one of group, batch, none",
    )
    check(a.is_level in ("sequence", "turn"), "algo.is_level", a.is_level, "one of sequence, turn")
    check(
        a.advantage_clip is None or a.advantage_clip > 0,
        "algo.advantage_clip",
        a.advantage_clip,
        "> 0, or null",
    )
    check(a.max_resample_rounds >= 0, "algo.max_resample_rounds", a.max_resample_rounds, ">= 0")
    if not POLICY_LOSSES.meta(loss).get("uses_ratio", True):
        rollout_batch = a.prompts_per_step * a.group_size
        check(
            a.update_epochs == 1,
            "algo.update_epochs",
            a.update_epochs,
            f"1 with algo.loss={loss}: it has no importance ratio, so a second epoch would follow an "
            "uncorrected off-policy gradient; use a clipped objective (ppo_clip, cispo) for more epochs",
        )
        check(
            a.mini_batch_size is None or a.mini_batch_size == rollout_batch,
            "algo.mini_batch_size",
            a.mini_batch_size,
            f"null (one update per rollout batch) with algo.loss={loss}: later mini-batches would be "
            "off-policy without an importance ratio",
        )
