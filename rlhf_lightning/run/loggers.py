"""Loggers: the configured one (csv, tensorboard, wandb) and always ``metrics.csv``, which
reaches the disk every ``logger.flush_every_n_steps`` steps and, when a run resumes in its own
directory, keeps the rows up to the checkpoint's step (Lightning's CSV logger would delete them)."""

from __future__ import annotations

import csv as csvlib
import io
from pathlib import Path
from typing import Any, cast

from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment
from omegaconf import DictConfig

from rlhf_lightning.run.rundir import write_atomic


class _ContinuingWriter(ExperimentWriter):
    """Keeps an existing ``metrics.csv``: its rows up to ``resume_step``, and its columns.

    Nothing is written until the first metrics are saved, which is after the checkpoint has
    loaded: a resume that fails leaves ``metrics.csv`` (and ``hparams.yaml``) as they were."""

    def __init__(self, log_dir: str, resume_step: int | None) -> None:
        self.resume_step = resume_step
        self._kept: list[dict[str, str]] | None = None  # rows written back at the first save
        super().__init__(log_dir=log_dir)

    def _check_log_dir_exists(self) -> None:
        path = Path(self.metrics_file_path)
        if self.resume_step is None or not path.is_file():
            super()._check_log_dir_exists()
            return
        with path.open(newline="") as f:
            reader = csvlib.DictReader(f)
            keys = list(reader.fieldnames or [])
            rows = [r for r in reader if r.get("step", "") == "" or int(r["step"]) <= self.resume_step]
        self._kept, self.metrics_keys = rows, keys

    def log_hparams(self, params: dict[str, Any]) -> None:
        if self._kept is None:
            super().log_hparams(params)
        else:
            self.hparams.update(params)  # written with the kept rows

    def save(self) -> None:
        if self._kept is not None and self.metrics:
            text = io.StringIO(newline="")
            writer = csvlib.DictWriter(text, fieldnames=self.metrics_keys)
            writer.writeheader()
            writer.writerows(self._kept)
            write_atomic(Path(self.metrics_file_path), text.getvalue())
            self._kept = None
            super().log_hparams({})  # hparams.yaml
        super().save()


class RunCSVLogger(CSVLogger):
    """``<output_dir>/metrics.csv``, flushed every ``flush_every`` steps; ``resume_step``: continue
    the file of a run resumed in place (rows after that step are dropped: they are redone)."""

    def __init__(self, output_dir: Path, flush_every: int = 10, resume_step: int | None = None) -> None:
        super().__init__(save_dir=str(output_dir), name="", version="", flush_logs_every_n_steps=flush_every)
        self.resume_step = resume_step

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _ContinuingWriter(self.log_dir, self.resume_step)
        return cast(ExperimentWriter, self._experiment)


def build_loggers(
    cfg: DictConfig, output_dir: Path, run_name: str, resume_step: int | None = None
) -> list[Any]:
    """The configured logger, and always ``metrics.csv`` (continued when a run resumes in place)."""
    lg = cfg.logger
    csv = RunCSVLogger(output_dir, lg.flush_every_n_steps, resume_step)
    if lg.name == "csv":
        return [csv]
    if lg.name == "tensorboard":
        from lightning.pytorch.loggers import TensorBoardLogger

        return [TensorBoardLogger(save_dir=str(output_dir), name="tensorboard", version=""), csv]
    try:
        import wandb  # noqa: F401
        from lightning.pytorch.loggers import WandbLogger
    except ImportError as err:
        raise ImportError("logger=wandb needs wandb: pip install 'rlhf_lightning[wandb]'") from err
    sweep = hydra_job()
    kwargs: dict[str, Any] = {
        "project": lg.project,
        "entity": lg.entity,
        "group": lg.group or (f"{cfg.name}-{sweep['sweep_dir_name']}" if sweep.get("multirun") else cfg.name),
        "tags": list(lg.tags) if lg.tags is not None else default_tags(cfg),
        "job_type": lg.job_type or ("sweep" if sweep.get("multirun") else "train"),
        "log_model": "all" if lg.log_model else False,
    }
    if lg.mode:
        kwargs["mode"] = lg.mode
    return [WandbLogger(name=run_name, save_dir=str(output_dir), **kwargs), csv]


def default_tags(cfg: DictConfig) -> list[str]:
    """``[algo, model, env]``: the env as its class name without ``Env`` (``ArithmeticEnv`` -> ``arithmetic``)."""
    env = str(cfg.env._target_).rsplit(".", 1)[-1].removesuffix("Env").lower()
    return [str(cfg.algo.name), str(cfg.model.name), env]


def hydra_job() -> dict[str, Any]:
    """What Hydra knows of this job (empty outside ``@hydra.main``): the command-line overrides,
    whether it is a multirun job, its number and its sweep directory's name."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
    except ValueError:
        return {}
    multirun = hc.mode == RunMode.MULTIRUN
    return {
        "overrides": list(hc.overrides.task),
        "multirun": multirun,
        "job_num": int(hc.job.num) if multirun else None,
        "sweep_dir_name": Path(hc.sweep.dir).name if multirun else None,
    }


def wandb_location(loggers: list[Any]) -> str | None:
    """The W&B run's URL (online) or its local directory (offline), when one of ``loggers`` is W&B."""
    from lightning.pytorch.loggers import WandbLogger  # importable without wandb installed

    for lg in loggers:
        if isinstance(lg, WandbLogger):
            run = lg.experiment
            return getattr(run, "url", None) or str(Path(run.dir).parent)
    return None
