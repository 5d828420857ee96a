"""What a resume checks before it touches the run directory: the checkpoint file is intact, holds
no pickled code and no NaN (:func:`verified_checkpoint`), and fits the model this config builds
(:func:`check_fits`). Each failure is one line naming the file (and the config field that
differs, when the run's ``config.yaml`` says which)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.run.rundir import CONFIG, config_changes
from rlhf_lightning.run.validation import check_checkpoint
from rlhf_lightning.runtime.checkpoint_file import CheckpointRefused, load_checkpoint, verify_checkpoint


def verified_checkpoint(field: str, path: str) -> dict[str, Any]:
    """The checkpoint ``path`` (given as ``field``: ``resume`` or ``ckpt_path``), loaded with its
    archive, pickles and values checked."""
    check_checkpoint(field, path)  # a zip archive of a Lightning checkpoint, or an earlier one named
    try:
        return verify_checkpoint(path)
    except CheckpointRefused as err:
        raise ConfigError(field, path, str(err)) from None


def _shape(t: torch.Tensor) -> str:
    return "x".join(map(str, t.shape)) or "scalar"


def _misfits(module: Any, saved: dict[str, torch.Tensor]) -> list[str]:
    """The checkpoint's weights (``saved``) whose shapes differ from ``module``'s. Only weights
    both hold are compared: some are added after the build (a population's members side by side)."""
    own = module.state_dict()
    return [
        f"{k} is {_shape(saved[k])} in the checkpoint but {_shape(own[k])} in this model"
        for k in sorted(own.keys() & saved.keys())
        if own[k].shape != saved[k].shape
    ]


def check_fits(field: str, path: str, module: Any, cfg: DictConfig) -> None:
    """Refuse (one line) a checkpoint whose weights do not fit ``module``: e.g. a changed
    ``model.lora.r`` resumed with ``resume_force=true``, which would otherwise fail inside
    Lightning's load with a wall of ``size mismatch`` lines, after the run directory changed."""
    weights = load_checkpoint(path).get("state_dict")  # verified at start-up; memory-mapped
    misfits = _misfits(module, weights if isinstance(weights, dict) else {})
    if not misfits:
        return
    saved = Path(path).resolve().parent.parent / CONFIG
    changes = config_changes(OmegaConf.load(saved), cfg) if saved.is_file() else []  # type: ignore[arg-type]
    model = [c for c in changes if c.startswith(("model.", "algo.", "population."))] or changes
    why = f"this config differs from its run's in {'; '.join(model[:4])}" if model else "its weights differ"
    shown = "; ".join(misfits[:2]) + (f" ... ({len(misfits)} in all)" if len(misfits) > 2 else "")
    raise ConfigError(
        field,
        path,
        f"a checkpoint whose weights fit this config's model, but {why} ({shown}); resume with the "
        "run's own settings, or start a new run",
    )
