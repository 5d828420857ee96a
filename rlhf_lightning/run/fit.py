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
from omegaconf import DictConfig, OmegaConf

from rlhf_lightning.callbacks.checkpoints import AtomicCheckpointIO
from rlhf_lightning.callbacks.objective import optimized_value
from rlhf_lightning.callbacks.signals import validate_or_stop
from rlhf_lightning.config import register_configs
from rlhf_lightning.run.factories import (  # noqa: F401  (build, training_reward, population_callback: the API)
    RunCallbacks,
    build,
    population_callback,
    run_callbacks,
    training_reward,
)
from rlhf_lightning.run.loggers import build_loggers, hydra_job, wandb_location
from rlhf_lightning.run.resume_checks import check_fits, verified_checkpoint
from rlhf_lightning.run.rundir import (
    check_same_run,
    claim_run_dir,
    clear_run,
    find_resumable,
    follow_resumed_run,
    hand_to_launched_ranks,
    handed_by_rank0,
    holds_run,
    process_rank,
    refuse_reuse,
    release_run_dir,
    remove_partials,
    save_run_config,
)
from rlhf_lightning.run.summary import summary_lines, write_plot
from rlhf_lightning.run.validation import check, validate
from rlhf_lightning.runtime.checkpoint_file import load_checkpoint
from rlhf_lightning.runtime.strategies import (
    build_strategy,
    distributed_job,
    pass_output_dir_to_other_ranks,
    single_job_argv,
)

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
    return int(load_checkpoint(path)["global_step"])


def prepare_run_dir(cfg: DictConfig) -> tuple[Path, str | None]:
    """This run's directory (claimed: no other live run writes there) and the checkpoint it
    resumes from (``ckpt_path``; or with ``resume=true``, ``output_dir``'s last checkpoint, or the
    newest ``outputs/<name>/*`` run of the same config, whose directory the run then continues).

    Everything is checked before the directory is claimed, and nothing is written into it here
    but the lock: ``config.yaml`` follows once the checkpoint has loaded (:class:`SaveRunConfig`)."""
    explicit = bool(cfg.output_dir)
    out = output_dir_for(cfg)
    launch_dir = None  # resume=true without output_dir: the directory Hydra made for this launch
    ckpt = cfg.ckpt_path
    if cfg.resume and not ckpt:
        if not explicit:
            # A multirun job (outputs/<name>/multirun/<time>/<job>) resumes the newest job of the
            # same config in any earlier sweep of this name; a single run, its newest sibling.
            multirun = bool(hydra_job().get("multirun"))
            root, pattern = (out.parent.parent, "*/*") if multirun else (out.parent, "*")
            launch_dir, out, explicit = out, find_resumable(root, cfg, exclude=out, pattern=pattern), True
        last = out / "checkpoints" / "last.ckpt"
        check(last.is_file(), "resume", True, f"a checkpoint at {last} (output_dir names the run to resume)")
        ckpt = str(last)
    in_place = bool(ckpt) and Path(str(ckpt)).resolve().parent.parent == out.resolve()
    check(
        not (cfg.overwrite and in_place),
        "overwrite",
        True,
        f"false when resuming in {out}: overwrite deletes the checkpoint the run resumes from",
    )
    # A rank Lightning's launcher started from rank 0 skips what rank 0 checked before starting
    # it (rank 0 may have written into ``out`` since). An external launcher's ranks (torchrun,
    # srun) all check: each refuses as rank 0 does, instead of waiting for it at the first
    # collective until strategy.timeout_s (see handed_by_rank0 for why they see the same files).
    handed = handed_by_rank0(out)
    if ckpt and not handed:
        verified_checkpoint("ckpt_path" if cfg.ckpt_path else "resume", ckpt)
        check_same_run(cfg, Path(ckpt).resolve().parent.parent, cfg.resume_force)
    if explicit and not in_place and not handed:
        refuse_reuse(out, overwrite=cfg.overwrite)
    if process_rank() != 0:  # rank 0 claims the directory (and clears it for overwrite=true)
        out.mkdir(parents=True, exist_ok=True)
        return out, ckpt
    out = claim_run_dir(out, explicit=explicit)
    remove_partials(out)
    if launch_dir is not None:
        follow_resumed_run(launch_dir, out)
    if cfg.overwrite and holds_run(out):
        clear_run(out)
    pass_output_dir_to_other_ranks(out)
    hand_to_launched_ranks(out)
    return out, ckpt


class SaveRunConfig(L.Callback):
    """``config.yaml`` (and ``.hydra/``) written when training starts: after a resumed run's
    checkpoint has loaded, so a resume that fails leaves the run's own config (and with it its
    ``resume=true``) as it was. Rank 0 writes."""

    def __init__(self, cfg: DictConfig, output_dir: Path) -> None:
        self.cfg, self.output_dir = cfg, output_dir

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            save_run_config(self.cfg, self.output_dir)


def finish_wandb() -> None:
    """End the W&B run so the next multirun job starts its own."""

    if "wandb" in sys.modules:
        import wandb

        if wandb.run is not None:
            wandb.finish()


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
    from lightning.pytorch.loggers import WandbLogger

    for lg in loggers:
        if isinstance(lg, WandbLogger) and adapters.is_dir():
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


def tuned_line(cfg: DictConfig) -> str:
    """Which tuned settings composed into ``cfg`` (conf/tuned/<model>/<family>.yaml), for the log."""
    family = cfg.get("family", "none")
    if cfg.get("tuned"):
        return f"tuned settings: conf/tuned/{cfg.tuned}.yaml (family {family}); the command line still overrides them"
    return f"tuned settings: none for this model and family {family} (conf/tuned/<model>/{family}.yaml)"


def _fit(
    cfg: DictConfig, extra_callbacks: Sequence[L.Callback], output_dir: Path, ckpt_path: str | None
) -> RunResult:
    started = time.perf_counter()
    log.info("%s", tuned_line(cfg))
    resume_step = None
    if ckpt_path:
        log.info("resuming from %s", ckpt_path)
        same_dir = Path(ckpt_path).resolve().parent.parent == output_dir.resolve()
        resume_step = checkpoint_step(ckpt_path) if same_dir else None
    module, dm = build(cfg, output_dir)
    if ckpt_path:  # before anything is written: a misfit is one line, the run directory untouched
        check_fits("ckpt_path" if cfg.ckpt_path else "resume", ckpt_path, module, cfg)
    loggers = run_loggers(cfg, output_dir, resume_step)
    cbs = run_callbacks(cfg, output_dir, [SaveRunConfig(cfg, output_dir), *extra_callbacks])
    trainer_kwargs = cast(dict[str, Any], OmegaConf.to_container(cfg.trainer, resolve=True))
    single_job_argv(output_dir)  # a multirun job's other ranks run this job only
    trainer = L.Trainer(
        **trainer_kwargs,
        strategy=build_strategy(cfg.strategy, cfg.algo.get("grad_clip")),
        plugins=[AtomicCheckpointIO()],
        logger=loggers,
        callbacks=cbs.all,
        default_root_dir=str(output_dir),
    )
    try:
        exit_code = _train(cfg, trainer, module, dm, ckpt_path, cbs)
        if trainer.is_global_zero:  # before W&B is finished: the plot and adapters go there too
            if cfg.logger.log_model:
                upload_adapters(trainer.loggers, output_dir / "checkpoints" / "adapters" / "last")
            show_result(output_dir, trainer, exit_code, time.perf_counter() - started)
    except BaseException as err:
        if not cbs.stop.pressed_twice(err):
            raise
        log.warning("stopped at once by a second Ctrl-C; the checkpoints saved before it are intact")
        raise SystemExit(128 + signal.SIGINT) from None
    finally:
        cbs.engine.close(module)
        cast(Any, module).shutdown()  # its workers (the async rollout producer), the env's servers
        finish_wandb()
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    objective = None
    if cfg.optimized_metric and trainer.is_global_zero and not exit_code:
        objective = optimized_value(
            output_dir, cfg.optimized_metric, cfg.optimized_mode, cfg.optimized_direction
        )
    return RunResult(metrics, module, trainer, output_dir, exit_code, objective)


def run_loggers(cfg: DictConfig, output_dir: Path, resume_step: int | None) -> list[Any]:
    """The ``logger`` group's loggers, each given the whole config (and Hydra's overrides)."""
    loggers = build_loggers(cfg, output_dir, f"{cfg.name}-{cfg.algo.name}-{output_dir.name}", resume_step)
    hparams = cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True, enum_to_str=True))
    job = hydra_job()  # the command line's overrides and the sweep job number, with the config
    for lg in loggers:
        lg.log_hyperparams({**hparams, "hydra": job} if job else hparams)
    if process_rank() == 0 and (where := wandb_location(loggers)):
        log.info("W&B run: %s", where)
    return loggers


def _train(
    cfg: DictConfig,
    trainer: L.Trainer,
    module: L.LightningModule,
    dm: L.LightningDataModule,
    ckpt_path: str | None,
    cbs: RunCallbacks,
) -> int:
    """Evaluate, fit, save and evaluate again; the exit code (128 + a signal's number: stopped
    by it, with a checkpoint; 1: stopped by the guard)."""
    exit_code = 0
    if cfg.eval.before_training and not ckpt_path:
        exit_code = validate_or_stop(trainer, module, dm, cbs.stop)
        if exit_code:  # a stop signal during it: nothing trained, nothing to save
            return exit_code
    # Checkpoints hold tensors and plain data only: loaded without unpickling code. (A second
    # Ctrl-C inside the fit ends in Lightning's exit code 1, which ``_fit`` turns into 130.)
    trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path, weights_only=True)
    if cbs.stop.stopped_by is not None:  # checkpoint saved at the signal's step
        exit_code = 128 + cbs.stop.stopped_by
    elif cbs.guard.stop_reason is not None:
        exit_code = 1
    else:
        if cfg.checkpoint.save_last:
            trainer.save_checkpoint(
                Path(trainer.default_root_dir) / "checkpoints" / "last.ckpt", weights_only=False
            )
        if cfg.eval.at_end and cast(Any, module).last_eval_step != trainer.global_step:
            exit_code = validate_or_stop(trainer, module, dm, cbs.stop)  # the checkpoint is saved
    if cbs.adapter_export is not None:  # the policy as the fit left it (a population: its best member)
        cbs.adapter_export.export_final(trainer, module)
    return exit_code
