"""Versions of the trainable weights as directories the inference servers read.

A version is written into a temporary directory beside its final place and renamed there, so a
server never reads a half-written one: with LoRA a PEFT adapter directory (the actor's,
``adapter_config.json`` + ``adapter_model.safetensors``), which the servers load at run time
under a name of its own; with full fine-tuning a model directory (``config.json`` +
safetensors), which the servers reload in place. ``root`` must be a directory the servers can
read (the same path on their node: a shared filesystem when they run elsewhere).

A version's files also travel as bytes (:meth:`VersionFiles.files`), so a checkpoint can hold
the versions that the batches in flight were generated with, and a resumed run writes them back.
"""

from __future__ import annotations

import contextlib
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from rlhf_lightning.models.adapters import save_adapters


class VersionFiles:
    """Writes, reads and removes version directories under ``root``.

    Args:
        root: the directory (created); each publication is ``root/<name>``.
        lora: LoRA adapters (True) or full model directories (False).
    """

    def __init__(self, root: str | Path, lora: bool) -> None:
        self.root, self.lora = Path(root), lora
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, name: str) -> Path:
        return self.root / name

    def write(self, name: str, policy: Any) -> Path:
        """``policy``'s trainable weights now, as ``root/<name>`` (atomically)."""
        with torch.inference_mode(False), torch.no_grad():
            return self._atomic(name, lambda tmp: self._save(policy, tmp))

    def write_files(self, name: str, files: dict[str, bytes]) -> Path:
        """A version's files (from :meth:`files`, e.g. a checkpoint's) as ``root/<name>``."""

        def save(tmp: Path) -> Path:
            tmp.mkdir(parents=True)
            for rel, data in files.items():
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                (tmp / rel).write_bytes(data)
            return tmp

        return self._atomic(name, save)

    def files(self, name: str) -> dict[str, bytes]:
        """Every file of ``root/<name>`` by its relative path."""
        base = self.path(name)
        return {str(p.relative_to(base)): p.read_bytes() for p in sorted(base.rglob("*")) if p.is_file()}

    def remove(self, name: str) -> None:
        shutil.rmtree(self.path(name), ignore_errors=True)

    def clear(self) -> None:
        """Remove every version (the root too, and its parent if nothing else is left there)."""
        shutil.rmtree(self.root, ignore_errors=True)
        with contextlib.suppress(OSError):
            self.root.parent.rmdir()

    # ---------------------------------------------------------------- helpers
    def _atomic(self, name: str, save: Any) -> Path:
        final = self.path(name)
        staging = self.root / f".tmp-{name}-{uuid.uuid4().hex[:8]}"
        try:
            written = save(staging)
            shutil.rmtree(final, ignore_errors=True)
            written.rename(final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return final

    def _save(self, policy: Any, staging: Path) -> Path:
        """Write the weights under ``staging``; returns the directory that becomes the version."""
        if self.lora:
            if policy.adapter_name is None:
                raise ValueError("a LoRA version needs a policy with a LoRA actor adapter")
            save_adapters(policy.model, staging, [policy.adapter_name], None, policy.adapter_state())
            own = staging / policy.adapter_name  # PEFT writes a non-default adapter in a folder of its own
            return own if own.is_dir() else staging
        # Every tensor of the state dict, tied ones too: a server reloading from files keeps a
        # tied lm_head of its own (vLLM's layerwise reload), which only an lm_head.weight updates.
        model = policy.causal_lm
        state = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in model.state_dict().items()}
        staging.mkdir(parents=True)
        save_file(state, str(staging / "model.safetensors"), metadata={"format": "pt"})
        model.config.save_pretrained(str(staging))
        return staging
