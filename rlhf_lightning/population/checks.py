"""Start-up checks of ``population.*``, and the rules a member's hyper-parameters obey.

Every invalid value fails before any model is loaded. The rules on one hyper-parameter value
(:func:`value_problem`) are the same at start-up (each end of a ``population.mutate`` range, or
each integer in it) and at every mutation during the run (:func:`check_member`), so a value
that would fail at start-up can never reach training.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf

from rlhf_lightning.config.algo import registered_name
from rlhf_lightning.config.errors import ConfigError, check
from rlhf_lightning.population.evolution import (
    DEFAULT_SPACE,
    FITNESS,
    INIT,
    INTEGER,
    MUTABLE,
    NODE_PREFIXES,
    SCHEDULES,
    SELECTION,
    MutationRange,
    flat_space,
    is_mutable,
)

# What each hyper-parameter must be, as its start-up check in run/validation.py / algorithms/checks.py.
DOMAINS = {
    "lr": "a learning rate > 0",
    "clip_low": "an offset in [0, 1) (the ratio's lower bound is 1 - clip_low)",
    "clip_high": "an offset > 0 (the ratio's upper bound is 1 + clip_high)",
    "beta": "a KL coefficient >= 0",
    "temperature": "a sampling temperature > 0",
    "group_size": "an integer >= 2 (group-relative advantages compare completions of one prompt)",
    "entropy_coef": ">= 0",
    "min_lr_ratio": "in [0, 1] (the cosine schedule's end, a share of lr)",
}


def _in_domain(name: str, v: float) -> bool:
    if name.startswith(NODE_PREFIXES):
        return math.isfinite(v)  # a function's own parameter: any number its params class takes
    if name == "clip_low":
        return 0.0 <= v < 1.0
    if name in ("beta", "entropy_coef"):
        return v >= 0.0
    if name == "group_size":
        return float(v).is_integer() and v >= 2
    if name == "min_lr_ratio":
        return 0.0 <= v <= 1.0
    return v > 0.0  # lr, clip_high, temperature


def group_size_problem(g: int, algo: Mapping[str, Any], world_size: int = 1) -> str | None:
    """Why ``g`` completions per prompt do not fit the configured batch geometry, or None.

    With ``mini_batch_size`` set, the optimizer steps per training step are ``prompts_per_step
    x group_size / mini_batch_size``: another group size would change them, and with them what
    ``trainer.max_steps`` and each member's schedule count, so it must stay the config's. Micro-
    batches split each rank's rollouts (``prompts_per_step / world_size x g``) evenly."""
    ppp, mini, micro = algo["prompts_per_step"], algo.get("mini_batch_size"), algo.get("micro_batch_size")
    if mini is not None and g != algo["group_size"]:
        return (
            f"with algo.mini_batch_size={mini} the group size must stay algo.group_size={algo['group_size']} "
            "(it sets the optimizer steps per training step); set algo.mini_batch_size=null or drop "
            "group_size from population.mutate"
        )
    rows = ppp // max(world_size, 1) * g  # this rank's rollouts (prompts_per_step is split over ranks)
    if micro is not None and mini is None:
        per_rank = micro // max(world_size, 1)
        if per_rank < 1 or rows % per_rank:
            return (
                f"algo.micro_batch_size={micro} must divide the rollout batch prompts_per_step x group_size "
                f"= {ppp * g} ({rows} per rank over {world_size}); choose a range whose every group size "
                "keeps it a divisor, or change algo.micro_batch_size"
            )
    return None


def value_problem(name: str, value: float, algo: Mapping[str, Any], world_size: int = 1) -> str | None:
    """Why ``value`` cannot be a member's ``name`` under the algorithm config ``algo`` (plain
    values, e.g. ``dataclasses.asdict(hp)``), or None."""
    if not _in_domain(name, value):
        return f"{name} must be {DOMAINS.get(name, 'a finite number')}"
    if name == "group_size":
        problem = group_size_problem(int(value), algo, world_size)
        if problem is not None:
            return problem
    if algo.get("use_liger_loss") and not name.startswith(NODE_PREFIXES):
        from rlhf_lightning.learner.liger_path import liger_unsupported

        reason = liger_unsupported(SimpleNamespace(**{**algo, name: value}))
        if reason is not None:
            return f"Liger's fused loss does not cover {reason} (algo.use_liger_loss=true)"
    return None


def check_member(
    hparams: Mapping[str, float], algo: Mapping[str, Any], world_size: int, member_id: int
) -> None:
    """Raise :class:`ConfigError` if any of a (mutated) member's hyper-parameters is invalid."""
    for name, value in hparams.items():
        problem = value_problem(name, value, algo, world_size)
        if problem is not None:
            raise ConfigError(
                f"population.mutate.{name}",
                value,
                f"member {member_id} was mutated to a value that cannot train: {problem}; narrow the range",
            )


def policy_losses(algo: Mapping[str, Any]) -> list[str] | None:
    """The registered policy losses the configured family trains with (None: not known here)."""
    if algo.get("loss") is not None:
        return [registered_name(algo["loss"])]
    if algo.get("module") == "ppo":
        return ["ppo_clip", "gspo"]  # PPOModule: per-token clip, or GSPO's pooled ratio per turn
    return None


def node_parameters(node: str, algo: Mapping[str, Any]) -> dict[str, Any] | None:
    """The parameters (name -> default) of the function ``algo.<node>`` names (``loss``: its params
    class's fields; ``advantage``: the estimator's ``params``, default None), or None if unknown."""
    from rlhf_lightning.losses import ADVANTAGE_ESTIMATORS, POLICY_LOSSES

    if node not in algo:
        return None
    name = registered_name(algo[node])
    if node == "loss" and name in POLICY_LOSSES:
        return {f.name: f.default for f in dataclasses.fields(POLICY_LOSSES.meta(name)["params"])}
    if node == "advantage" and name in ADVANTAGE_ESTIMATORS:
        return dict.fromkeys(ADVANTAGE_ESTIMATORS.meta(name).get("params", ()))
    return None


def node_value(algo: Mapping[str, Any], path: str) -> Any:
    """The configured value of ``loss.<param>`` / ``advantage.<param>``: the node's, else the
    function's default."""
    node, param = path.split(".", 1)
    own = algo.get(node)
    if isinstance(own, Mapping) and param in own:
        return own[param]
    return (node_parameters(node, algo) or {}).get(param)


def node_problem(path: str, algo: Mapping[str, Any]) -> str | None:
    """Why the node path ``loss.<param>`` / ``advantage.<param>`` cannot be mutated, or None."""
    node, param = path.split(".", 1)
    params = node_parameters(node, algo)
    if params is None:
        return f"algo={algo.get('name')} has no registered algo.{node}: mutating {path} would change nothing"
    flat = param if node == "loss" else f"advantage_{param}"
    if flat in algo:
        return f"{path} is the flat field algo.{flat}: mutate {flat} (among {', '.join(MUTABLE)})"
    if param not in params:
        return (
            f"algo.{node}={registered_name(algo[node])} has no parameter {param} (it has "
            f"{', '.join(sorted(params)) or 'none'}); drop it from population.mutate"
        )
    value = node_value(algo, path)
    if not isinstance(value, int | float) or isinstance(value, bool):
        return f"{path}={value!r} is not a number; set it in algo.{node} or drop it"
    return None


def unused_problem(name: str, algo: Mapping[str, Any], finetune: str) -> str | None:
    """Why mutating ``name`` would do nothing or break the run under this config, or None."""
    if name == "temperature":
        return None  # the sampler's, every rollout algorithm has one
    if name.startswith(NODE_PREFIXES):
        return node_problem(name, algo)
    where = f"algo={algo.get('name')}"
    if name not in algo:
        return f"{where} has no {name}: mutating it would change nothing; drop it from population.mutate"
    if name in ("clip_low", "clip_high"):
        from rlhf_lightning.losses import POLICY_LOSSES

        for loss in policy_losses(algo) or []:
            params = POLICY_LOSSES.meta(loss).get("params")
            if params is None or name not in {f.name for f in dataclasses.fields(params)}:
                return (
                    f"algo.loss={loss} does not use {name}: mutating it would change nothing; drop it "
                    "from population.mutate"
                )
    if algo[name] is None:
        return (
            f"algo.{name} is null in {where} (the objective does not use it); set algo.{name} to a value "
            "or drop it from population.mutate"
        )
    if name == "beta" and finetune != "lora" and algo["beta"] == 0:
        return (
            "model.finetune=full with algo.beta=0 builds no reference model for a KL term; set algo.beta > 0 "
            "or drop beta from population.mutate"
        )
    return None


def range_values(name: str, low: float, high: float, algo: Mapping[str, Any]) -> list[float]:
    """The values of a range that decide whether all of it is valid.

    A real hyper-parameter's valid values form an interval: its two ends. ``group_size``: the
    integers from ``low``, until the micro-batch divisibility (periodic in the group size with a
    period dividing ``micro_batch_size``) and the fixed size under ``mini_batch_size`` have all
    been seen, and ``high``."""
    if name not in INTEGER:
        return [low, high]
    period = max(int(algo.get("micro_batch_size") or 1), 2)
    first = list(range(int(low), min(int(high), int(low) + period) + 1))
    return [float(g) for g in dict.fromkeys([*first, int(high)])]


def validate_space(
    mutate: Mapping[str, Any], algo: Mapping[str, Any], finetune: str, world_size: int
) -> None:
    """Every ``population.mutate`` range: a hyper-parameter the algorithm uses, and only valid values."""
    for name, r in mutate.items():
        field, shown = f"population.mutate.{name}", dict(r)
        problem = unused_problem(name, algo, finetune)
        check(problem is None, field, shown, str(problem))
        low, high = float(r["low"]), float(r["high"])
        if name in INTEGER:
            check(
                low.is_integer() and high.is_integer(),
                field,
                shown,
                f"integer low and high: {name} is a count",
            )
        for v in range_values(name, low, high, algo):
            problem = value_problem(name, v, algo, world_size)
            check(
                problem is None,
                field,
                shown,
                f"the range allows {name}={v:g}, but {problem}; narrow the range",
            )


def configured_world_size(cfg: DictConfig) -> int:
    """Processes from ``trainer.devices x num_nodes`` (1 when ``devices`` is ``auto``)."""
    devices = cfg.trainer.devices
    return devices * cfg.trainer.num_nodes if isinstance(devices, int) and devices > 0 else 1


def validate_population(p: DictConfig, spec: Any, cfg: DictConfig) -> None:
    """``population.*`` at start-up (``cfg``: the whole composed config)."""
    check(p.size >= 1, "population.size", p.size, "at least 1 (1: no population)")
    if p.size == 1:
        return
    check(
        spec.data == "online",
        "population.size",
        p.size,
        "1 for SFT and DPO: populations train rollout algorithms",
    )
    check(
        cfg.strategy.name != "fsdp",
        "strategy.name",
        cfg.strategy.name,
        f"ddp with population.size={p.size} (members are swapped in and out of the policy's weights, "
        "which FSDP shards; the run would hang at the end): use strategy=ddp, or population.size=1",
    )
    batched = side_by_side(cfg)
    every = default_evolve_every(p.size, batched) if p.evolve_every is None else p.evolve_every
    if batched:
        check(
            every >= 0, "population.evolve_every", every, "population steps between evolutions, or 0 (never)"
        )
        validate_side_by_side(p.size, cfg)
    else:
        check(
            every >= 0 and every % p.size == 0,
            "population.evolve_every",
            every,
            f"a multiple of population.size={p.size} (every member trains as often), or 0 (never evolve)",
        )
    check(p.fitness in FITNESS, "population.fitness", p.fitness, f"one of {', '.join(FITNESS)}")
    if p.get("schedule", "pbt") == "mf_pbt":
        validate_multi_frequency(p, every)
    check(p.eval_rows > 0, "population.eval_rows", p.eval_rows, "> 0")
    check(
        1 <= p.tournament_size <= p.size,
        "population.tournament_size",
        p.tournament_size,
        f"in [1, population.size={p.size}] (members drawn for each tournament, without replacement)",
    )
    check(
        0.0 < p.truncation <= 0.5, "population.truncation", p.truncation, "in (0, 0.5] (the share replaced)"
    )
    check(0.0 <= p.resample_prob <= 1.0, "population.resample_prob", p.resample_prob, "in [0, 1]")
    check(0.0 <= p.no_mutation_prob <= 1.0, "population.no_mutation_prob", p.no_mutation_prob, "in [0, 1]")
    check(p.snapshot_every >= 0, "population.snapshot_every", p.snapshot_every, ">= 0")
    keep = p.get("keep_snapshots")
    check(keep is None or keep >= 1, "population.keep_snapshots", keep, ">= 1 (the newest are kept)")
    check(
        p.mutate is None or isinstance(p.mutate, DictConfig | dict),
        "population.mutate",
        p.mutate,
        f"{{name: {{low, high, scale}}}} with names among {', '.join(MUTABLE)} or loss.<param> / advantage.<param>",
    )
    mutate = flat_space(p.mutate if p.mutate is not None else DEFAULT_SPACE)
    check(
        all(is_mutable(name) for name in mutate),
        "population.mutate",
        p.mutate,
        f"{{name: {{low, high, scale}}}} with names among {', '.join(MUTABLE)} or loss.<param> / advantage.<param>",
    )
    for name, r in mutate.items():
        ok = (
            isinstance(r, DictConfig | dict)
            and set(r) <= {"low", "high", "scale", "prior"}
            and {"low", "high"} <= set(r)
        )
        ok = ok and 0 <= r["low"] <= r["high"] and r.get("scale", 1.5) > 1
        prior = r.get("prior") if ok else None
        ok = ok and prior in (None, "log", "uniform") and (prior != "log" or r["low"] > 0)
        check(
            ok,
            f"population.mutate.{name}",
            r,
            "{low, high, scale, prior} with 0 <= low <= high, scale > 1 and prior log (low > 0), uniform or null",
        )
    algo = cast(dict[str, Any], OmegaConf.to_container(cfg.algo, resolve=True))
    validate_space(mutate, algo, cfg.model.finetune, configured_world_size(cfg))
    if batched:  # after the mutation space: its group-size rules name the cause more precisely
        check_population_steps(p.size, cfg)


def validate_multi_frequency(p: DictConfig, every: int) -> None:
    """``population.schedule=mf_pbt``: sub-populations that split ``population.size``, each of
    at least two members, at strictly rising intervals; and evolutions to schedule them by."""
    from rlhf_lightning.population.multi_frequency import MultiFrequency

    check(
        every > 0, "population.evolve_every", every, "> 0 with population.schedule=mf_pbt (a round's steps)"
    )
    node = p.get("mf_pbt")
    try:
        MultiFrequency.from_config(p.size, node)
    except ValueError as e:
        shown = OmegaConf.to_container(node) if isinstance(node, DictConfig) else node
        check(False, "population.mf_pbt", shown, str(e).removeprefix("population.mf_pbt: "))


def side_by_side(cfg: DictConfig) -> bool:
    """Whether the population's members train side by side: ``population.batched``; when null,
    whenever the run allows it (LoRA members, no dynamic sampling, not ``rollout=vllm_server``),
    else round-robin."""
    batched = cfg.population.get("batched")
    if batched is not None:
        return bool(batched)
    return bool(
        cfg.model.finetune == "lora"
        and not cfg.algo.get("dynamic_sampling", False)
        and cfg.rollout.get("engine") != "vllm_server"  # a server request samples one adapter
    )


def default_evolve_every(size: int, batched: bool) -> int:
    """50 updates of each member: population steps side by side, training steps round-robin."""
    return 50 if batched else 50 * size


def validate_side_by_side(size: int, cfg: DictConfig) -> None:
    """What members side by side (``population.batched=true``) cover so far."""
    where = f"population.batched=true (population.size={size})"
    check(
        cfg.model.finetune == "lora",
        "model.finetune",
        cfg.model.finetune,
        f"lora with {where}: members are LoRA adapters on one frozen base; set population.batched=false "
        "for full fine-tuning",
    )
    check(
        not cfg.algo.get("dynamic_sampling", False),
        "algo.dynamic_sampling",
        cfg.algo.get("dynamic_sampling"),
        f"false with {where} (refills per member are not built yet); set population.batched=false",
    )
    check(
        cfg.rollout.get("engine") != "vllm_server",
        "rollout",
        "vllm_server",
        f"hf or vllm with {where}: an inference server samples one adapter per request, not one per "
        "row; set population.batched=false (members take turns, round-robin)",
    )


def check_population_steps(size: int, cfg: DictConfig) -> None:
    """Side by side, ``trainer.max_steps`` counts member updates: a whole number of population
    steps, each ``size`` members x the optimizer steps of one batch. The members' bank checks
    it again at fit start; here it is refused before any model loads, when ``trainer.devices``
    (a count, or ``auto``) gives the world size."""
    import torch

    from rlhf_lightning.learner.plan import UpdatePlan

    devices, max_steps = cfg.trainer.devices, cfg.trainer.max_steps
    if devices in ("auto", -1):  # Lightning's: every CUDA device, or one process on the CPU
        cuda = cfg.trainer.accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available()
        devices = torch.cuda.device_count() if cuda else 1
    if not isinstance(devices, int) or devices < 1 or max_steps <= 0:
        return
    per = (
        UpdatePlan.from_hp(cast(Any, cfg.algo), devices * cfg.trainer.num_nodes).optimizer_steps_per_batch()
        * size
    )
    check(
        max_steps % per == 0,
        "trainer.max_steps",
        max_steps,
        f"it counts member updates: each population step takes {per} ({size} members x {per // size} "
        f"optimizer steps); set a multiple of {per}",
    )


def check_settings(
    size: int,
    evolve_every: int,
    space: dict[str, MutationRange],
    fitness: str,
    keep_snapshots: int,
    every_multiple_of_size: bool = True,
    init: str = "config",
    selection: str = "tournament",
    truncation: float = 0.25,
    resample_prob: float = 0.0,
    schedule: str = "pbt",
) -> None:
    """The population's own settings (a population callback's constructor checks them)."""
    if init not in INIT or selection not in SELECTION or schedule not in SCHEDULES:
        raise ValueError(
            f"population.init={init!r} (one of {INIT}), population.selection={selection!r} (one of "
            f"{SELECTION}), population.schedule={schedule!r} (one of {SCHEDULES})"
        )
    if not 0.0 < truncation <= 0.5 or not 0.0 <= resample_prob <= 1.0:
        raise ValueError(
            f"population.truncation={truncation} must be in (0, 0.5] and population.resample_prob={resample_prob} in [0, 1]"
        )
    if init == "sample" and not space:
        raise ValueError("population.init=sample needs a population.mutate space to draw the members from")
    if size < 2:
        raise ValueError(f"population.size must be at least 2, got {size}")
    if evolve_every < 0 or (every_multiple_of_size and evolve_every and evolve_every % size):
        raise ValueError(
            f"population.evolve_every={evolve_every}: a multiple of population.size={size}, or 0"
        )
    if fitness not in FITNESS:
        raise ValueError(f"population.fitness={fitness!r}: one of {', '.join(FITNESS)}")
    unknown = sorted(name for name in space if not is_mutable(name))
    if unknown:
        raise ValueError(
            f"population.mutate: unknown hyper-parameters {unknown}; choose among {MUTABLE}, or a "
            "loss.<param> / advantage.<param> of the configured function"
        )
    if keep_snapshots < 1:
        raise ValueError(f"population.keep_snapshots must be at least 1, got {keep_snapshots}")
