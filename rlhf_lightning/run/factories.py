"""Wiring from config: every component of a run built by a small factory from its config node.

    tokenizer_from(model, env) -> harness_from(cfg, ...) -> model_from(model) -> policy_from(...)
    -> build_engine(cfg, ...) -> module_and_data(cfg, ...)                       = build(cfg)
    run_callbacks(cfg, output_dir)                                                 the run's callbacks

A knob is read in the factory of its node only: adding one touches its schema, its YAML and
the factory (and the constructor it reaches).
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import lightning as L
import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from rlhf_lightning.algorithms.checks import resolve_algo
from rlhf_lightning.algorithms.spec import AlgorithmSpec, get_algorithm
from rlhf_lightning.callbacks import AdapterExport, SameConfigOnAllRanks, SampleTable, config_digest
from rlhf_lightning.callbacks.checkpoints import BestCheckpoint, KeepLast, StepCheckpoint
from rlhf_lightning.callbacks.configured import configured_callbacks
from rlhf_lightning.callbacks.guard import Guard
from rlhf_lightning.callbacks.objective import CheckOptimizedMetric
from rlhf_lightning.callbacks.progress import ProgressLog, StepProgressBar, auto_every
from rlhf_lightning.callbacks.signals import StopOnSignal
from rlhf_lightning.data.offline import OfflineDataModule
from rlhf_lightning.data.prompts import PromptDataModule
from rlhf_lightning.envs.factory import env_factory, split_sizes
from rlhf_lightning.models.build import build_policy, load_model, load_tokenizer
from rlhf_lightning.models.policy import Policy
from rlhf_lightning.population.callback import Population
from rlhf_lightning.population.checks import default_evolve_every, side_by_side
from rlhf_lightning.population.evolution import DEFAULT_SPACE, MutationRange, flat_space
from rlhf_lightning.population.side_by_side import SideBySidePopulation
from rlhf_lightning.rewards import CombinedReward, build_reward
from rlhf_lightning.rollout.async_plan import AsyncSettings
from rlhf_lightning.rollout.async_producer import Placement
from rlhf_lightning.rollout.async_rollout import AsyncRollouts
from rlhf_lightning.rollout.callback import RolloutEngineCallback
from rlhf_lightning.rollout.chat import ChatFormatter, check_template, env_tools
from rlhf_lightning.rollout.engine import SamplingParams
from rlhf_lightning.rollout.harness import RolloutHarness
from rlhf_lightning.rollout.hf import HFEngine
from rlhf_lightning.rollout.server_async import ServerRollouts
from rlhf_lightning.run.server_factory import server_engine, server_rollouts

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- model, env, engine
def tokenizer_from(m: DictConfig, e: DictConfig) -> Any:
    """The ``model`` node's tokenizer, with the chat template the ``env`` needs."""
    return load_tokenizer(
        m.tokenizer_path or m.path,
        revision=m.revision,
        trust_remote_code=m.trust_remote_code,
        pad_token=m.pad_token,
        chat_template=m.chat_template,
        need_chat_template=e.apply_chat_template,
        field="model.tokenizer_path" if m.tokenizer_path else "model.path",
    )


def harness_from(cfg: DictConfig, tokenizer: Any, spec: AlgorithmSpec) -> tuple[RolloutHarness, int, int]:
    """The ``env`` node's rollout harness (the ``reward`` group for online families), and the
    sizes of its train and eval splits."""
    e = cfg.env
    factory = env_factory(e._target_, cast(dict[str, Any], OmegaConf.to_container(e.kwargs, resolve=True)))
    train_rows, eval_rows = split_sizes(factory, e.train_size, e.eval_size)
    formatter = ChatFormatter(tokenizer, e.system_prompt, e.apply_chat_template, tools=env_tools(factory))
    check_template(formatter, multi_turn=e.max_turns > 1, history=e.history)
    harness = RolloutHarness(
        factory,
        tokenizer,
        formatter,
        max_turns=e.max_turns,
        max_model_len=e.max_model_len,
        on_reward_error=e.on_reward_error,
        reward=training_reward(cfg.reward) if spec.data == "online" else None,
        concurrency=e.concurrency,
        step_timeout_s=e.step_timeout_s,
        step_workers=e.step_workers,
        history=e.history,
        history_k=e.history_k,
    )
    return harness, train_rows, eval_rows


def model_from(m: DictConfig) -> Any:
    """The ``model`` node's causal LM (quantized, with Liger's kernels, as it asks)."""
    return load_model(
        m.path,
        dtype=m.dtype,
        attn_implementation=m.attn_implementation,
        revision=m.revision,
        trust_remote_code=m.trust_remote_code,
        quantization=m.quantization,
        quant_type=m.quant_type,
        double_quant=m.double_quant,
        compute_dtype=m.compute_dtype,
        liger_kernels=m.liger_kernels,
    )


def policy_from(
    model: Any, m: DictConfig, a: DictConfig, spec: AlgorithmSpec, hp: Any, actor_only: bool = False
) -> Policy:
    """The trainable policy on ``model``: the adapters (or full model), reference and critic the
    algorithm family needs; ``actor_only``: the actor alone (the async rollout producer's copy)."""
    return build_policy(
        model,
        finetune=m.finetune,
        lora_r=m.lora.r,
        lora_alpha=m.lora.alpha,
        lora_dropout=m.lora.dropout,
        lora_target_modules=m.lora.target_modules,
        need_reference=not actor_only and spec.needs_reference(hp),
        gradient_checkpointing=m.gradient_checkpointing and not actor_only,
        adapter_path=m.adapter_path,
        reference_from_checkpoint=m.reference_from_checkpoint and not actor_only,
        separate_reference=a.use_separate_reference_adapter and not actor_only,
        with_critic=spec.needs_critic and not actor_only,
    )


def sampling_from(r: DictConfig) -> SamplingParams:
    """The ``rollout`` node's training sampling parameters."""
    return SamplingParams(
        r.max_new_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        stop_token_ids=tuple(r.stop_token_ids),
        stop=tuple(r.stop),
        repetition_penalty=r.repetition_penalty,
        min_p=r.min_p,
    )


def build_engine(
    cfg: DictConfig, policy: Any, tokenizer: Any, kind: str | None = None, output_dir: Path | None = None
) -> Any:
    """The rollout engine ``kind`` (default: ``rollout.engine``): HF ``generate`` on the policy
    itself, a colocated vLLM (started lazily), or vLLM servers (logs and weights in ``output_dir``)."""
    r = cfg.rollout
    if (kind or r.engine) == "vllm_server":
        return server_engine(cfg, output_dir)
    if (kind or r.engine) == "hf":
        return HFEngine(
            policy.generation_model,
            tokenizer.pad_token_id,
            [tokenizer.eos_token_id],
            r.max_batch_size,
            tokenizer=tokenizer,
        )
    from rlhf_lightning.rollout.vllm import VLLMEngine

    m = cfg.model
    dtype = r.dtype if r.dtype != "auto" else m.dtype
    return VLLMEngine(
        m.path,
        m.tokenizer_path,
        dtype=dtype,
        max_model_len=r.max_model_len or cfg.env.max_model_len,
        lora_rank=m.lora.r if m.finetune == "lora" else None,
        gpu_memory_utilization=r.gpu_memory_utilization,
        kv_cache_memory_bytes=r.kv_cache_memory_bytes,
        enforce_eager=r.enforce_eager,
        sleep_mode=r.sleep_mode,
        sleep_mode_level=r.sleep_mode_level,
        lora_staging_dir=r.lora_staging_dir,
        seed=r.seed if r.seed is not None else cfg.seed,  # + the rank, once the trainer knows it
        enable_prefix_caching=r.enable_prefix_caching,
    )


def training_reward(rw: DictConfig) -> CombinedReward | None:
    """The ``reward`` group as a :class:`CombinedReward` (None: the env's rewards as they are)."""
    fns = OmegaConf.to_container(rw.fn) if isinstance(rw.fn, ListConfig) else rw.fn
    weights = OmegaConf.to_container(rw.weights) if isinstance(rw.weights, DictConfig) else rw.weights
    model_kwargs = {
        "path": rw.model_path,
        "batch_size": rw.model_batch_size,
        "max_len": rw.model_max_len,
        "normalize": rw.normalize,
        "offload": rw.offload,
        "dtype": rw.model_dtype,
    }
    return build_reward(list(rw.sources), fns, weights, model_kwargs)


# population.* fields a population callback takes by name (besides size, evolve_every, mutate)
POPULATION_SETTINGS = (
    "fitness", "eval_rows", "init", "selection", "truncation", "tournament_size", "elitism",
    "no_mutation_prob", "resample_prob", "mutate_initial", "snapshot_every", "keep_snapshots",
)  # fmt: skip


def population_callback(cfg: DictConfig, output_dir: Path) -> Population | SideBySidePopulation:
    """The ``population`` config as a :class:`SideBySidePopulation` callback, or with
    ``population.batched=false`` (or a run that needs it, :func:`side_by_side`) a round-robin
    :class:`Population`."""
    p = cfg.population
    space = {name: MutationRange(**dict(r)) for name, r in flat_space(p.mutate or DEFAULT_SPACE).items()}
    batched = side_by_side(cfg)
    kind = SideBySidePopulation if batched else Population
    why = (
        " (population.batched=null and this run needs it)" if p.get("batched") is None and not batched else ""
    )
    log.info("population of %d: members %s%s", p.size, "side by side" if batched else "round-robin", why)
    every = p.evolve_every if p.evolve_every is not None else default_evolve_every(p.size, batched)
    settings = {k: p[k] for k in POPULATION_SETTINGS}
    return kind(p.size, every, space, output_dir, seed=cfg.seed, **settings)


# ---------------------------------------------------------------- asynchronous rollouts
@dataclass(frozen=True)
class ProducerBuild:
    """Builds the rollout producer's parts in its own process (``rollout.mode=async``): the
    harness, the engine and a policy of the same structure as the trainer's actor (no reference,
    no critic), from the run's resolved config (YAML, so it pickles)."""

    config_yaml: str

    def __call__(self, place: Placement) -> tuple[RolloutHarness, Any, Policy]:
        """The parts on ``place``: the HF engine's policy on its device; a vLLM engine bound to
        its rank and CUDA device (its policy stays on the CPU: it only exports the weights)."""
        cfg = cast(DictConfig, OmegaConf.create(self.config_yaml))
        m, a = cfg.model, cfg.algo
        spec = get_algorithm(a.module)
        tokenizer = tokenizer_from(m, cfg.env)
        harness, _, _ = harness_from(cfg, tokenizer, spec)
        policy = policy_from(model_from(m), m, a, spec, None, actor_only=True)
        engine = build_engine(cfg, policy, tokenizer)
        if cfg.rollout.engine == "hf":
            policy.to(place.device)
        else:
            engine.bind_rank(place.rank, place.world_size, place.cuda_index or 0)
        return harness, engine, policy


def async_rollouts_from(
    cfg: DictConfig, output_dir: Path | None = None, policy: Any = None, tokenizer: Any = None
) -> AsyncRollouts | ServerRollouts | None:
    """The ``rollout`` node's producer (``mode=async``; its spool in ``output_dir``), the servers'
    (``rollout=vllm_server``: publishing ``policy``, on a harness of their own), or None (``sync``)."""
    r = cfg.rollout
    if r.mode != "async":
        return None
    settings = AsyncSettings(
        max_staleness=r.max_staleness,
        partial=r.partial,
        partial_versions=r.partial_versions,
        timeout_s=r.async_timeout_s,
        threads=r.producer_threads or torch.get_num_threads(),
        seed=cfg.seed,
        devices=tuple(r.devices) if r.devices is not None else None,
        spool_dir=str(output_dir) if output_dir is not None else None,
    )
    if r.engine == "vllm_server":
        harness, _, _ = harness_from(cfg, tokenizer, get_algorithm(cfg.algo.module))
        return server_rollouts(cfg, output_dir, settings, harness, policy)
    return AsyncRollouts(ProducerBuild(OmegaConf.to_yaml(cfg, resolve=True)), settings, cfg.env.max_turns)


# ---------------------------------------------------------------- module and data
def build(cfg: DictConfig, output_dir: Path) -> tuple[L.LightningModule, L.LightningDataModule]:
    """Tokenizer, env, model, engine and LightningModule from a validated config."""
    m, a = cfg.model, cfg.algo
    spec = get_algorithm(a.module)
    tokenizer = tokenizer_from(m, cfg.env)
    harness, train_rows, eval_rows = harness_from(cfg, tokenizer, spec)
    model = model_from(m)
    resolve_algo(
        a
    )  # as validate() did: the loss and advantage nodes, clip bounds left at auto the loss's own
    hp = OmegaConf.to_object(a)
    policy = policy_from(model, m, a, spec, hp)
    # async: the producer holds the run's engine; the trainer evaluates (and refills) with HF generate
    engine = build_engine(cfg, policy, tokenizer, "hf" if cfg.rollout.mode == "async" else None, output_dir)
    evals = {
        "eval_greedy": cfg.eval.greedy,
        "eval_sampled": cfg.eval.sampled,
        "eval_num_samples": cfg.eval.num_samples,
    }
    sampling = sampling_from(cfg.rollout)
    if spec.data == "online":
        module = spec.module_cls(
            policy,
            harness,
            engine,
            sampling,
            hp,
            **evals,
            num_samples_to_keep=cfg.samples.num,
            num_train_rows=train_rows,
            async_rollouts=async_rollouts_from(cfg, output_dir, policy, tokenizer),
        )
        dm: L.LightningDataModule = PromptDataModule(
            train_rows, eval_rows, a.prompts_per_step, cfg.eval.batch_size, seed=cfg.seed
        )
    else:
        module = spec.module_cls(policy, hp, harness, engine, sampling, **evals)
        dm = offline_data(cfg, spec, harness, eval_rows)
    module.eval_info_metrics = tuple(cfg.eval.info_metrics)
    return module, dm


def offline_data(
    cfg: DictConfig, spec: AlgorithmSpec, harness: RolloutHarness, eval_rows: int
) -> OfflineDataModule:
    """An offline family's data file (SFT, DPO), and the env's eval rows with ``algo.env_eval``."""
    a = cfg.algo
    keys = {k: a.get(f"{k}_key", k) for k in ("messages", "prompt", "completion", "chosen", "rejected")}
    return OfflineDataModule(
        spec.offline_kind or "sft",
        a.data_path,
        harness.formatter,
        keys,
        a.batch_size,
        a.max_len,
        eval_path=a.eval_data_path,
        eval_fraction=a.eval_fraction,
        env_eval_rows=eval_rows if a.env_eval else 0,
        env_eval_batch_size=cfg.eval.batch_size,
        seed=cfg.seed,
        packing=bool(getattr(a, "packing", False)),
    )


# ---------------------------------------------------------------- the run's callbacks
@dataclass
class RunCallbacks:
    """The callbacks a run passes to the trainer, and the ones it asks afterwards why it stopped."""

    all: list[L.Callback]
    stop: StopOnSignal
    guard: Guard
    engine: RolloutEngineCallback
    adapter_export: AdapterExport | None


def checkpoint_callbacks(cfg: DictConfig, ckpt_dir: Path) -> list[L.Callback]:
    """Step checkpoints (``checkpoint.every_n_steps``, ``last.ckpt``), pruning, the best one."""
    c = cfg.checkpoint
    out: list[L.Callback] = [
        StepCheckpoint(
            dirpath=ckpt_dir,
            filename="step_{step:06d}",
            every_n_train_steps=c.every_n_steps or None,
            every_n_epochs=0,  # not at epoch ends: a stopped run's last.ckpt stays the stop step's
            save_top_k=-1,  # KeepLast prunes
            save_last=c.save_last,
            auto_insert_metric_name=False,
            # last.ckpt is also written by the signal and guard stops: overwrite it, never make
            # last-v1.ckpt (which keep_last would not know about)
            enable_version_counter=False,
        ),
        KeepLast(ckpt_dir, c.keep_last),
    ]
    if c.monitor:
        out.append(BestCheckpoint(ckpt_dir, c.monitor, c.monitor_mode, c.export_adapters))
    return out


def run_callbacks(cfg: DictConfig, output_dir: Path, extra: list[L.Callback]) -> RunCallbacks:
    """Checkpoints, the signal stop, the guard, exports, samples, progress, the population, the
    config checks, the engine's lifecycle; then the ``callbacks`` group's and ``extra``."""
    ckpt_dir = output_dir / "checkpoints"
    callbacks = checkpoint_callbacks(cfg, ckpt_dir)
    g = cfg.guard
    stop = StopOnSignal(ckpt_dir)
    guard = Guard(
        ckpt_dir,
        patience=g.patience,
        empty_frac=g.empty_frac,
        stop_on_collapse=g.stop_on_collapse,
        max_nonfinite_steps=g.max_nonfinite_steps,
    )
    callbacks += [stop, guard]
    adapter_export = AdapterExport(ckpt_dir) if cfg.checkpoint.export_adapters else None
    if adapter_export is not None:
        callbacks.append(adapter_export)
    if cfg.samples.every_n_steps > 0:
        callbacks.append(SampleTable(cfg.samples.every_n_steps, output_dir))
    if cfg.trainer.enable_progress_bar:
        callbacks.append(StepProgressBar(leave=True))
    lines_every = cfg.progress.every_n_steps
    if lines_every != 0 and not sys.stdout.isatty():  # a log file, CI, SLURM: the bar shows nothing there
        callbacks.append(ProgressLog(lines_every or auto_every(cfg.trainer.max_steps)))
    if cfg.population.size > 1:
        callbacks.insert(0, population_callback(cfg, output_dir))
    callbacks.append(SameConfigOnAllRanks(config_digest(cfg)))
    if cfg.optimized_metric:
        callbacks.append(CheckOptimizedMetric(cfg.optimized_metric))
    engine = RolloutEngineCallback(getattr(cfg.rollout, "offload_trainer_during_rollout", False))
    callbacks.append(engine)
    callbacks.extend(configured_callbacks(cfg.callbacks))  # the config's own, after the run's
    callbacks.extend(extra)
    return RunCallbacks(callbacks, stop, guard, engine, adapter_export)
