"""Train an RL fine-tuning run: ``python train.py algo=cispo model=qwen0.5b env=arithmetic``."""

from __future__ import annotations

import logging
import os
import traceback

import hydra
from omegaconf import DictConfig

from rlhf_lightning.config import register_configs
from rlhf_lightning.config.early import early_checks
from rlhf_lightning.config.errors import ConfigError, UserCodeError

register_configs()


def lightning_logging_as_before_hydra() -> None:
    """Lightning's loggers as they are when Lightning is imported before Hydra sets up logging
    (it was, before the run's import moved into ``main`` for fast failure): each of
    ``lightning.pytorch`` and ``lightning.fabric`` prints through its own handler and does not
    propagate. Imported after Hydra's handlers exist, Lightning would propagate instead, and its
    lines would print twice and land in a refused run's train.log."""
    for name in ("lightning.pytorch", "lightning.fabric"):
        logger = logging.getLogger(name)
        logger.setLevel(logging.INFO)
        if not logger.handlers:
            logger.addHandler(logging.StreamHandler())
        logger.propagate = False


lightning_logging_as_before_hydra()


def user_code_failure(err: UserCodeError) -> str:
    """What a failure of user code shows: the traceback of its cause (the user's frames, or the
    worker process's traceback as its note), then the message naming what failed."""
    cause = err.__cause__
    shown = "".join(traceback.format_exception(cause)) if cause is not None else ""
    hint = "(HYDRA_FULL_ERROR=1 shows the trainer's frames too)"
    return f"{shown}\nerror: {err}\n{hint}"


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    try:
        early_checks(cfg)  # common fields' values, before the heavy imports below
        from rlhf_lightning.run import run  # here: a bad key fails in Hydra's composition, before torch

        result = run(cfg)
    except ConfigError as err:  # a bad value: the message says which and what is allowed, no traceback
        raise SystemExit(f"error: {err}") from None
    except UserCodeError as err:  # your code's traceback and what failed, not the trainer's frames
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        raise SystemExit(user_code_failure(err)) from None
    if result.exit_code:  # stopped by a signal (128 + its number) or by the guard (1), checkpoint saved
        raise SystemExit(result.exit_code)
    return result.objective  # optimized_metric's final (or best) value: what a sweeper optimises


if __name__ == "__main__":
    main()
