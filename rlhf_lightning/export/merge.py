"""``--merge``: the base model with the actor adapter folded in (or a full fine-tuning
checkpoint's weights), merged in float32 and cast once to the export's dtype; checkpoints are
loaded with ``torch.load(weights_only=True)``."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import torch
from transformers import PreTrainedModel

from rlhf_lightning.export.source import Source, fail, one_line, remote_code_hint
from rlhf_lightning.models.build import DTYPES, load_model
from rlhf_lightning.runtime.checkpoint_file import CheckpointRefused, load_checkpoint

CHECKPOINT_PREFIX = "policy.model."  # the LightningModule's keys for the wrapped model's weights


def merge_dtype(requested: str, run_dtype: str, stored: str | None) -> str:
    """The dtype a merged model is saved in: ``--dtype``, else the run's ``model.dtype``, else
    the base checkpoint's stored dtype (``stored``; float32 when unknown or not one of DTYPES)."""
    for name in (requested, run_dtype):
        if name != "auto":
            return name
    return stored if stored in DTYPES else "float32"


def stored_dtype(source: Source) -> str | None:
    """The dtype the base checkpoint is saved in (its ``config.json``), e.g. ``"bfloat16"``."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(
            source.base, revision=source.revision, trust_remote_code=source.trust_remote_code
        )
    except (OSError, ValueError):
        return None  # loading the base itself fails next, with the message
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    return str(dtype).removeprefix("torch.") if dtype is not None else None


def checkpoint_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    """The model weights in a Lightning checkpoint, loaded without unpickling arbitrary objects.

    ``weights_only=True``: a file that holds other pickled objects (which loading would execute)
    is refused; our checkpoints hold only tensors and plain values. ``mmap``: optimizer states are
    never read into memory."""
    try:
        state = load_checkpoint(ckpt)
    except CheckpointRefused as err:
        raise fail(str(err)) from err
    weights = state.get("state_dict")
    if not isinstance(weights, dict):
        raise fail(f"{ckpt} has no state_dict; is it a Lightning checkpoint written by train.py?")
    return {k[len(CHECKPOINT_PREFIX) :]: v for k, v in weights.items() if k.startswith(CHECKPOINT_PREFIX)}


def load_base(source: Source, dtype: str) -> PreTrainedModel:
    """The base model in ``dtype``, with the run's revision (and its own code only with
    ``--trust-remote-code``), in eval mode."""
    try:
        model = load_model(
            source.base, dtype=dtype, revision=source.revision, trust_remote_code=source.trust_remote_code
        )
    except (OSError, ValueError, RuntimeError) as err:
        raise fail(
            f"cannot load the base model {source.base!r} ({one_line(err)}); pass --base with a local "
            f"copy of the model the run trained{remote_code_hint(source)}"
        ) from err
    return model.eval()


def merged_model(source: Source, dtype: str = "auto") -> PreTrainedModel:
    """The base with the actor adapter folded in (or a full fine-tuning checkpoint's weights),
    in ``merge_dtype(dtype, source.dtype, stored)``.

    Everything happens in float32 and is cast once at the end. Merging in bf16 instead rounds
    twice when the base is stored in float32 (base to bf16, then base + delta); and saving a
    float32 run in its base checkpoint's bf16 loses every delta below bf16's spacing."""
    stored = stored_dtype(source) if dtype == "auto" and source.dtype == "auto" else None
    target = DTYPES[merge_dtype(dtype, source.dtype, stored)]
    weights = checkpoint_weights(source.checkpoint) if source.checkpoint is not None else None
    model = load_base(source, "float32")
    if weights is not None:
        missing, unexpected = model.load_state_dict(weights, strict=False)  # copies: cast to float32
        tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
        if set(missing) - tied or unexpected:
            raise fail(
                f"{source.checkpoint} does not match {source.base}: missing {sorted(missing)[:3]}, "
                f"unexpected {sorted(unexpected)[:3]}; pass --base with the model the run trained"
            )
    else:
        from peft import PeftModel

        try:
            peft = PeftModel.from_pretrained(model, str(source.actor))
        except (OSError, ValueError, RuntimeError, KeyError) as err:
            raise fail(
                f"cannot apply the adapter {source.actor} to {source.base!r} ({one_line(err)}); pass "
                "--base with the model the adapter was trained on"
            ) from err
        model = cast(PreTrainedModel, peft.merge_and_unload())  # W + B A * scale, in float32
    torch.nn.Module.to(model, target)  # the one rounding (in place)
    model.config.dtype = target  # config.json names the saved dtype
    return model
