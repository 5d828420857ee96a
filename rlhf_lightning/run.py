"""Compose -> build -> fit: what ``train.py`` (and the notebook) runs."""

from __future__ import annotations

import logging
import signal
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import lightning as L
import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from rlhf_lightning.algorithms.checks import resolve_clip_defaults
from rlhf_lightning.algorithms.spec import get_algorithm
from rlhf_lightning.callbacks import AdapterExport, SameConfigOnAllRanks, SampleTable, config_digest
from rlhf_lightning.callbacks.checkpoints import AtomicCheckpointIO, BestCheckpoint, KeepLast, StepCheckpoint
from rlhf_lightning.callbacks.configured import configured_callbacks
from rlhf_lightning.callbacks.guard import Guard
from rlhf_lightning.callbacks.objective import CheckOptimizedMetric, optimized_value
from rlhf_lightning.callbacks.progress import ProgressLog, StepProgressBar, auto_every
from rlhf_lightning.callbacks.signals import StopOnSignal
from rlhf_lightning.config import register_configs
from rlhf_lightning.data.offline import OfflineDataModule
from rlhf_lightning.data.prompts import PromptDataModule
from rlhf_lightning.envs.chat import ChatFormatter, check_template, env_tools
from rlhf_lightning.envs.factory import env_factory, split_sizes
from rlhf_lightning.envs.harness import RolloutHarness
from rlhf_lightning.loggers import build_loggers, hydra_job, wandb_location
from rlhf_lightning.models.build import build_policy, load_model, load_tokenizer
from rlhf_lightning.population.callback import Population
from rlhf_lightning.population.evolution import DEFAULT_SPACE, MutationRange
from rlhf_lightning.rewards import CombinedReward, build_reward
from rlhf_lightning.rollout.callback import RolloutEngineCallback
from rlhf_lightning.rollout.engine import SamplingParams
from rlhf_lightning.rollout.hf import HFEngine
from rlhf_lightning.rundir import (
    check_same_run,
    claim_run_dir,
    find_resumable,
    process_rank,
    release_run_dir,
    save_run_config,
)
from rlhf_lightning.strategies import (
    build_strategy,
    distributed_job,
    pass_output_dir_to_other_ranks,
    single_job_argv,
)
from rlhf_lightning.summary import summary_lines, write_plot
from rlhf_lightning.validation import check, check_checkpoint, validate

log = logging.getLogger(__name__)

register_configs()

# Known-harmless messages that would bury the useful ones.
for _pattern, _category in (
    (".*is_gradient_checkpointing.*", FutureWarning),  # transformers, through peft
    ("Experiment logs directory .* exists and is not empty.*", UserWarning),  # Hydra's train.log is there
    ("Using ModelCheckpoint with manual optimization.*", UserWarning),  # post-update state is what we save
    (".*isinstance\\(treespec, LeafSpec\\).*", Warning),
):
    warnings.filterwarnings("ignore", message=_pattern, category=_category)


class _NoTips(logging.Filter):
    """Drop Lightning's product tips ("💡 Tip: ... try installing litlogger") and its TPU/HPU lines
    from the console (the GPU line stays)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(("💡 Tip", "TPU available", "HPU available"))


for _name in (
    "lightning.pytorch.utilities.rank_zero",
    "lightning.fabric.utilities.rank_zero",
    "lightning_utilities.core.rank_zero",
):
    logging.getLogger(_name).addFilter(_NoTips())


def output_dir_for(cfg: DictConfig) -> Path:
    if cfg.output_dir:
        return Path(cfg.output_dir)
    try:
        from hydra.core.hydra_config import HydraConfig

        return Path(HydraConfig.get().runtime.output_dir)
    except ValueError:  # not under @hydra.main (e.g. the Python API)
        return Path("outputs") / cfg.name / time.strftime("%Y-%m-%d_%H-%M-%S")


def checkpoint_step(path: str | Path) -> int:
    """The optimizer steps done in a Lightning checkpoint (its ``global_step``)."""
    return int(torch.load(path, map_location="cpu", weights_only=True, mmap=True)["global_step"])


def prepare_run_dir(cfg: DictConfig) -> tuple[Path, str | None]:
    """This run's directory (claimed: no other live run writes there) and the checkpoint it
    resumes from (``ckpt_path``; or with ``resume=true``, ``output_dir``'s last checkpoint, or the
    newest ``outputs/<name>/*`` run of the same config, whose directory the run then continues)."""
    explicit = bool(cfg.output_dir)
    out = output_dir_for(cfg)
    ckpt = cfg.ckpt_path
    if cfg.resume and not ckpt:
        if not explicit:
            # A multirun job (outputs/<name>/multirun/<time>/<job>) resumes the newest job of the
            # same config in any earlier sweep of this name; a single run, its newest sibling.
            multirun = bool(hydra_job().get("multirun"))
            root, pattern = (out.parent.parent, "*/*") if multirun else (out.parent, "*")
            out, explicit = find_resumable(root, cfg, exclude=out, pattern=pattern), True
        last = out / "checkpoints" / "last.ckpt"
        check(last.is_file(), "resume", True, f"a checkpoint at {last} (output_dir names the run to resume)")
        check_checkpoint("resume", str(last))
        ckpt = str(last)
    if ckpt:
        check_same_run(cfg, Path(ckpt).resolve().parent.parent, cfg.resume_force)
    if process_rank() != 0:  # the other ranks are handed rank 0's directory
        out.mkdir(parents=True, exist_ok=True)
        return out, ckpt
    out = claim_run_dir(out, explicit=explicit)
    save_run_config(cfg, out)
    pass_output_dir_to_other_ranks(out)
    return out, ckpt


def finish_wandb() -> None:
    """End the W&B run so the next multirun job starts its own."""
    import sys

    if "wandb" in sys.modules:
        import wandb

        if wandb.run is not None:
            wandb.finish()


def build_engine(cfg: DictConfig, policy: Any, tokenizer: Any) -> Any:
    """The rollout engine: HF ``generate`` on the policy itself, or a colocated vLLM (started lazily)."""
    r = cfg.rollout
    if r.engine == "hf":
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


def population_callback(p: DictConfig, output_dir: Path, seed: int) -> Population:
    """The ``population`` config as a :class:`Population` callback."""
    space = {name: MutationRange(**dict(r)) for name, r in (p.mutate or DEFAULT_SPACE).items()}
    return Population(
        p.size,
        p.evolve_every if p.evolve_every is not None else 50 * p.size,
        space,
        output_dir,
        fitness=p.fitness,
        eval_rows=p.eval_rows,
        tournament_size=p.tournament_size,
        elitism=p.elitism,
        no_mutation_prob=p.no_mutation_prob,
        mutate_initial=p.mutate_initial,
        snapshot_every=p.snapshot_every,
        keep_snapshots=p.keep_snapshots,
        seed=seed,
    )


def build(cfg: DictConfig, output_dir: Path) -> tuple[L.LightningModule, L.LightningDataModule]:
    """Tokenizer, env, model, engine and LightningModule from a validated config."""
    m, e, r, a = cfg.model, cfg.env, cfg.rollout, cfg.algo
    tokenizer = load_tokenizer(
        m.tokenizer_path or m.path,
        revision=m.revision,
        trust_remote_code=m.trust_remote_code,
        pad_token=m.pad_token,
        chat_template=m.chat_template,
        need_chat_template=e.apply_chat_template,
        field="model.tokenizer_path" if m.tokenizer_path else "model.path",
    )
    factory = env_factory(e._target_, cast(dict[str, Any], OmegaConf.to_container(e.kwargs, resolve=True)))
    train_rows, eval_rows = split_sizes(factory, e.train_size, e.eval_size)
    spec = get_algorithm(a.module)
    formatter = ChatFormatter(tokenizer, e.system_prompt, e.apply_chat_template, tools=env_tools(factory))
    check_template(formatter, multi_turn=e.max_turns > 1)
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
    )
    model = load_model(
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
    resolve_clip_defaults(a)  # as validate() did: clip bounds left at auto are the loss's own
    hp = OmegaConf.to_object(a)
    policy = build_policy(
        model,
        finetune=m.finetune,
        lora_r=m.lora.r,
        lora_alpha=m.lora.alpha,
        lora_dropout=m.lora.dropout,
        lora_target_modules=m.lora.target_modules,
        need_reference=spec.needs_reference(hp),
        gradient_checkpointing=m.gradient_checkpointing,
        adapter_path=m.adapter_path,
        reference_from_checkpoint=m.reference_from_checkpoint,
        separate_reference=a.use_separate_reference_adapter,
        with_critic=spec.needs_critic,
    )
    engine = build_engine(cfg, policy, tokenizer)
    sampling = SamplingParams(
        r.max_new_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        stop_token_ids=tuple(r.stop_token_ids),
        stop=tuple(r.stop),
        repetition_penalty=r.repetition_penalty,
        min_p=r.min_p,
    )
    evals = {
        "eval_greedy": cfg.eval.greedy,
        "eval_sampled": cfg.eval.sampled,
        "eval_num_samples": cfg.eval.num_samples,
    }
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
        )
        module.eval_info_metrics = tuple(cfg.eval.info_metrics)
        dm: L.LightningDataModule = PromptDataModule(
            train_rows, eval_rows, a.prompts_per_step, cfg.eval.batch_size, seed=cfg.seed
        )
        return module, dm
    module = spec.module_cls(policy, hp, harness, engine, sampling, **evals)
    module.eval_info_metrics = tuple(cfg.eval.info_metrics)
    keys = {k: a.get(f"{k}_key", k) for k in ("messages", "prompt", "completion", "chosen", "rejected")}
    dm = OfflineDataModule(
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
    return module, dm


@dataclass
class RunResult:
    metrics: dict[str, float]  # the last value of every logged metric
    module: L.LightningModule
    trainer: L.Trainer
    output_dir: Path
    exit_code: int = 0  # 128 + signal number: stopped by a signal; 1: stopped by the guard
    objective: float | None = None  # optimized_metric's final or best value (rank 0; None if unset)


def show_result(output_dir: Path, trainer: L.Trainer, exit_code: int, wall_s: float) -> None:
    """``plots.png`` in the run directory (and to TensorBoard/W&B), then the summary table as the
    last lines on the console and in ``train.log``."""
    for lg in trainer.loggers:
        lg.save()  # metrics.csv complete on disk before it is read back
    write_plot(output_dir, trainer.loggers, trainer.global_step)
    head = "run finished" if not exit_code else f"run stopped (exit code {exit_code})"
    lines = summary_lines(output_dir, wall_s, trainer.global_step)
    where = wandb_location(trainer.loggers)
    if where:
        lines.append(f"{'wandb':<10} {where}")
    log.info("%s: %s\n%s", head, output_dir, "\n".join(lines))


def upload_adapters(loggers: Sequence[Any], adapters: Path) -> None:
    """The final PEFT adapters as a W&B ``model`` artifact (``logger.log_model=true``)."""
    for lg in loggers:
        if type(lg).__name__ == "WandbLogger" and adapters.is_dir():
            import wandb

            artifact = wandb.Artifact(f"adapters-{lg.experiment.id}", type="model")
            artifact.add_dir(str(adapters))
            lg.experiment.log_artifact(artifact, aliases=["latest"])


def run(cfg: DictConfig, extra_callbacks: Sequence[L.Callback] = ()) -> RunResult:
    """Train with ``cfg`` (a composed ``conf/config.yaml``): validate, build, evaluate, fit, evaluate."""
    with distributed_job():
        return _run(cfg, extra_callbacks)


def _run(cfg: DictConfig, extra_callbacks: Sequence[L.Callback]) -> RunResult:
    validate(cfg)
    if cfg.num_threads is not None:
        torch.set_num_threads(cfg.num_threads)
    # Claim the run directory before anything logs: Hydra's job log already points at its
    # train.log, so a run refused here (a live run holds it) must not have written a line there.
    output_dir, ckpt_path = prepare_run_dir(cfg)
    L.seed_everything(cfg.seed, workers=True)
    try:
        return _fit(cfg, extra_callbacks, output_dir, ckpt_path)
    finally:
        release_run_dir(output_dir)


def _fit(
    cfg: DictConfig, extra_callbacks: Sequence[L.Callback], output_dir: Path, ckpt_path: str | None
) -> RunResult:
    started = time.perf_counter()
    resume_step = None
    if ckpt_path:
        log.info("resuming from %s", ckpt_path)
        resume_step = (
            checkpoint_step(ckpt_path)
            if Path(ckpt_path).resolve().parent.parent == output_dir.resolve()
            else None
        )
    module, dm = build(cfg, output_dir)
    run_name = f"{cfg.name}-{cfg.algo.name}-{output_dir.name}"
    loggers = build_loggers(cfg, output_dir, run_name, resume_step)
    hparams = cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True))
    job = hydra_job()  # the command line's overrides and the sweep job number, with the config
    for lg in loggers:
        lg.log_hyperparams({**hparams, "hydra": job} if job else hparams)
    if process_rank() == 0 and (where := wandb_location(loggers)):
        log.info("W&B run: %s", where)
    ckpt_dir = output_dir / "checkpoints"
    every = cfg.checkpoint.every_n_steps or None
    callbacks: list[L.Callback] = [
        StepCheckpoint(
            dirpath=ckpt_dir,
            filename="step_{step:06d}",
            every_n_train_steps=every,
            every_n_epochs=0,  # not at epoch ends: a stopped run's last.ckpt stays the stop step's
            save_top_k=-1,  # KeepLast prunes
            save_last=cfg.checkpoint.save_last,
            auto_insert_metric_name=False,
            # last.ckpt is also written by the signal and guard stops: overwrite it, never make
            # last-v1.ckpt (which keep_last would not know about)
            enable_version_counter=False,
        ),
        KeepLast(ckpt_dir, cfg.checkpoint.keep_last),
    ]
    if cfg.checkpoint.monitor:
        callbacks.append(
            BestCheckpoint(
                ckpt_dir, cfg.checkpoint.monitor, cfg.checkpoint.monitor_mode, cfg.checkpoint.export_adapters
            )
        )
    stop = StopOnSignal(ckpt_dir)
    g = cfg.guard
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
        callbacks.insert(0, population_callback(cfg.population, output_dir, cfg.seed))
    callbacks.append(SameConfigOnAllRanks(config_digest(cfg)))
    if cfg.optimized_metric:
        callbacks.append(CheckOptimizedMetric(cfg.optimized_metric))
    engine_callback = RolloutEngineCallback(getattr(cfg.rollout, "offload_trainer_during_rollout", False))
    callbacks.append(engine_callback)
    callbacks.extend(configured_callbacks(cfg.callbacks))  # the config's own, after the run's
    callbacks.extend(extra_callbacks)
    trainer_kwargs = cast(dict[str, Any], OmegaConf.to_container(cfg.trainer, resolve=True))
    single_job_argv(output_dir)  # a multirun job's other ranks run this job only
    trainer = L.Trainer(
        **trainer_kwargs,
        strategy=build_strategy(cfg.strategy),
        plugins=[AtomicCheckpointIO()],
        logger=loggers,
        callbacks=callbacks,
        default_root_dir=str(output_dir),
    )
    exit_code = 0
    try:
        if cfg.eval.before_training and not ckpt_path:
            trainer.validate(module, datamodule=dm, verbose=False)
        try:  # checkpoints hold tensors and plain data only: loaded without unpickling code
            trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path, weights_only=True)
        except SystemExit:
            if stop.interrupted:  # Lightning exits 1 on a KeyboardInterrupt: the guard's code
                raise SystemExit(128 + signal.SIGINT) from None
            raise
        if stop.stopped_by is not None:  # checkpoint saved at the signal's step
            exit_code = 128 + stop.stopped_by
        elif guard.stop_reason is not None:
            exit_code = 1
        else:
            if cfg.checkpoint.save_last:
                trainer.save_checkpoint(ckpt_dir / "last.ckpt", weights_only=False)
            if cfg.eval.at_end and module.last_eval_step != trainer.global_step:
                trainer.validate(module, datamodule=dm, verbose=False)
        if adapter_export is not None:  # the policy as the fit left it (a population: its best member)
            adapter_export.export_final(trainer, module)
        if trainer.is_global_zero:  # before W&B is finished: the plot and adapters go there too
            if cfg.logger.log_model:
                upload_adapters(trainer.loggers, ckpt_dir / "adapters" / "last")
            show_result(output_dir, trainer, exit_code, time.perf_counter() - started)
    finally:
        engine_callback.close(module)
        finish_wandb()
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    objective = None
    if cfg.optimized_metric and trainer.is_global_zero and not exit_code:
        objective = optimized_value(
            output_dir, cfg.optimized_metric, cfg.optimized_mode, cfg.optimized_direction
        )
    return RunResult(metrics, module, trainer, output_dir, exit_code, objective)
