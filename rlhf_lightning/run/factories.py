"""Wiring from config: every component of a run built by a small factory from its config node.

    tokenizer_from(model, env) -> harness_from(cfg, ...) -> model_from(model) -> policy_from(...)
    -> build_engine(cfg, ...)            (run/parts.py: what the rollout producer builds too)
    -> module_and_data(cfg, ...)                                                    = build(cfg)
    run_callbacks(cfg, output_dir)                                                 the run's callbacks

A knob is read in the factory of its node only: adding one touches its schema, its YAML and
the factory (and the constructor it reaches).
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from omegaconf import DictConfig, OmegaConf

from rlhf_lightning.algorithms.checks import resolve_algo
from rlhf_lightning.algorithms.spec import AlgorithmSpec, get_algorithm
from rlhf_lightning.callbacks import AdapterExport, SameConfigOnAllRanks, SampleTable, config_digest
from rlhf_lightning.callbacks.checkpoints import BestCheckpoint, KeepLast, StepCheckpoint
from rlhf_lightning.callbacks.configured import configured_callbacks
from rlhf_lightning.callbacks.guard import Guard
from rlhf_lightning.callbacks.objective import CheckOptimizedMetric
from rlhf_lightning.callbacks.progress import ProgressLog, StepProgressBar, auto_every
from rlhf_lightning.callbacks.signals import StopOnSignal
from rlhf_lightning.callbacks.traces import RolloutTraces
from rlhf_lightning.data.offline import OfflineDataModule
from rlhf_lightning.data.prompts import PromptDataModule
from rlhf_lightning.learner.teacher import Teacher, check_teacher_tokenizer
from rlhf_lightning.population.callback import Population
from rlhf_lightning.population.checks import default_evolve_every, side_by_side
from rlhf_lightning.population.evolution import DEFAULT_SPACE, MutationRange, flat_space
from rlhf_lightning.population.side_by_side import SideBySidePopulation
from rlhf_lightning.rollout.asynchronous.driver import AsyncDriver
from rlhf_lightning.rollout.asynchronous.plan import AsyncSettings
from rlhf_lightning.rollout.asynchronous.process import ProcessTransport
from rlhf_lightning.rollout.engines.callback import RolloutEngineCallback
from rlhf_lightning.rollout.episodes.harness import RolloutHarness
from rlhf_lightning.run.parts import (  # noqa: F401  (re-exported: the factories' old place)
    ProducerBuild,
    build_engine,
    harness_from,
    model_from,
    policy_from,
    sampling_from,
    tokenizer_from,
    training_reward,
)
from rlhf_lightning.run.server_factory import server_rollouts

log = logging.getLogger(__name__)


# population.* fields a population callback takes by name (besides size, evolve_every, mutate)
POPULATION_SETTINGS = (
    "fitness", "eval_rows", "init", "selection", "truncation", "tournament_size", "elitism",
    "no_mutation_prob", "resample_prob", "mutate_initial", "snapshot_every", "keep_snapshots",
    "schedule", "mf_pbt",
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
def async_driver_from(
    cfg: DictConfig, output_dir: Path | None = None, policy: Any = None, tokenizer: Any = None
) -> AsyncDriver | None:
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
        harness, _, _ = harness_from(cfg, tokenizer, online=True)
        return server_rollouts(cfg, output_dir, settings, harness, policy)
    transport = ProcessTransport(ProducerBuild(OmegaConf.to_yaml(cfg, resolve=True)), settings)
    return AsyncDriver(transport, settings, cfg.env.max_turns)


# ---------------------------------------------------------------- module and data
def build(cfg: DictConfig, output_dir: Path) -> tuple[L.LightningModule, L.LightningDataModule]:
    """Tokenizer, env, model, engine and LightningModule from a validated config."""
    m, a = cfg.model, cfg.algo
    spec = get_algorithm(a.module)
    tokenizer = tokenizer_from(m, cfg.env)
    teacher = teacher_from(a, tokenizer)  # a teacher with another tokenizer fails before any model loads
    harness, train_rows, eval_rows = harness_from(cfg, tokenizer, online=spec.data == "online")
    model = model_from(m)
    resolve_algo(
        a
    )  # as validate() did: the loss and advantage nodes, clip bounds left at auto the loss's own
    hp = OmegaConf.to_object(a)
    policy = policy_from(model, m, a, need_reference=spec.needs_reference(hp), with_critic=spec.needs_critic)
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
            driver=async_driver_from(cfg, output_dir, policy, tokenizer),
            teacher=teacher,
        )
        dm: L.LightningDataModule = PromptDataModule(
            train_rows, eval_rows, a.prompts_per_step, cfg.eval.batch_size, seed=cfg.seed
        )
    else:
        module = spec.module_cls(policy, hp, harness, engine, sampling, **evals)
        dm = offline_data(cfg, spec, harness, eval_rows)
    module.eval_info_metrics = tuple(cfg.eval.info_metrics)
    return module, dm


def teacher_from(a: DictConfig, tokenizer: Any) -> Teacher | None:
    """``algo.teacher``: its tokenizer checked against the student's, then its model loaded
    (None without ``algo.teacher.path``)."""
    t = a.get("teacher")
    if t is None or t.path is None:
        return None
    check_teacher_tokenizer(tokenizer, str(t.path), t.revision)
    return Teacher.load(str(t.path), revision=t.revision, dtype=str(t.dtype), offload=bool(t.offload))


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
    if cfg.trace.every_n_steps > 0:
        callbacks.append(RolloutTraces(output_dir=output_dir, **cfg.trace))
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
