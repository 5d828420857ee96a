"""Named LoRA adapters on one frozen base: actor, reference, critic.

Saved layout (any of them may be absent)::

    <dir>/actor/adapter_config.json, adapter_model.safetensors
    <dir>/reference/...
    <dir>/critic/...  + value_head.safetensors

Each subdirectory loads with ``PeftModel.from_pretrained(base, "<dir>/actor")``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel
from safetensors.torch import load_file, save_file

from rlhf_lightning.config.errors import ConfigError

ACTOR, REFERENCE, CRITIC = "actor", "reference", "critic"
VALUE_HEAD_FILE = "value_head.safetensors"


def adapter_dir(path: str | Path, name: str) -> Path | None:
    """``path/name`` when it holds an adapter; for the actor also ``path`` itself."""
    p = Path(path).expanduser()
    if (p / name / "adapter_config.json").is_file():
        return p / name
    if name == ACTOR and (p / "adapter_config.json").is_file():
        return p
    return None


def _targets(cfg: Any) -> Any:
    t = cfg.target_modules
    return sorted(t) if isinstance(t, (set, list, tuple)) else t


def lora_summary(cfg: Any) -> str:
    return f"r={cfg.r}, lora_alpha={cfg.lora_alpha}, target_modules={_targets(cfg)}"


def check_same_lora(saved: Any, wanted: Any, where: Path) -> None:
    """A LoRA config that does not match the checkpoint fails with both shown."""
    if (saved.r, saved.lora_alpha, _targets(saved)) != (wanted.r, wanted.lora_alpha, _targets(wanted)):
        raise ConfigError(
            "model.lora",
            lora_summary(wanted),
            f"the adapter at {where} was trained with {lora_summary(saved)}; set model.lora to match it",
        )


def load_into(peft_model: PeftModel, directory: Path, name: str) -> None:
    """Load the adapter saved in ``directory`` into the existing adapter ``name`` (configs must match)."""
    saved = LoraConfig.from_pretrained(str(directory))
    check_same_lora(saved, peft_model.peft_config[name], directory)
    tmp = f"_loading_{name}"
    peft_model.load_adapter(str(directory), adapter_name=tmp, is_trainable=False)
    copy_adapter(peft_model, tmp, name)
    peft_model.delete_adapter(tmp)


@torch.no_grad()
def copy_adapter(peft_model: PeftModel, src: str, dst: str) -> None:
    """Copy adapter ``src``'s weights onto adapter ``dst`` (same shapes)."""
    params = dict(peft_model.named_parameters())
    copied = 0
    for name, p in params.items():
        if f".{src}." in name:
            params[name.replace(f".{src}.", f".{dst}.")].copy_(p)
            copied += 1
    if copied == 0:
        raise KeyError(f"adapter {src!r} has no parameters to copy onto {dst!r}")


def adapter_state(peft_model: PeftModel, names: list[str]) -> dict[str, torch.Tensor]:
    """The named adapters' weights as full tensors, keyed as in ``peft_model.state_dict()``.

    Under FSDP2 each sharded weight is all-gathered: every rank must call this, in step.
    """
    from torch.distributed.tensor import DTensor

    out = {}
    for key, value in peft_model.state_dict().items():
        if any(f".{n}." in key for n in names):
            out[key] = value.full_tensor() if isinstance(value, DTensor) else value
    return out


def save_adapters(
    peft_model: PeftModel,
    directory: str | Path,
    names: list[str],
    value_head: torch.nn.Module | None,
    state: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write each named adapter to ``directory/<name>`` (and the critic's value head beside it).

    ``state``: the adapters' full weights from :func:`adapter_state` (needed when sharded)."""
    directory = Path(directory)
    peft_model.save_pretrained(str(directory), selected_adapters=names, state_dict=state)
    if value_head is not None and CRITIC in names:
        save_file(
            {k: v.detach().cpu().contiguous() for k, v in value_head.state_dict().items()},
            str(directory / CRITIC / VALUE_HEAD_FILE),
        )
    return directory


def load_value_head(value_head: torch.nn.Module, directory: Path) -> bool:
    f = directory / VALUE_HEAD_FILE
    if not f.is_file():
        return False
    value_head.load_state_dict(load_file(str(f)))
    return True
