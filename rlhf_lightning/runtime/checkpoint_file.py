"""Reading a checkpoint file someone hands us: the one place that loads one (resume and export).

load_checkpoint    ``torch.load(weights_only=True)``: a file that pickles code is refused in one
                   line naming it (torch's own error advises ``weights_only=False``, which would run it)
verify_checkpoint  that, after the zip archive's CRCs are checked (flipped bytes in a tensor's
                   storage load silently otherwise), and with every floating tensor of its weights
                   and optimizer state finite (a NaN weight would surface as a sampling error later)

Both raise :class:`CheckpointRefused`, whose message names the file and says what to do.
"""

from __future__ import annotations

import pickle
import re
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch


class CheckpointRefused(ValueError):
    """A checkpoint that must not or cannot be loaded; the message names the file."""


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def load_checkpoint(path: str | Path, *, mmap: bool = True) -> dict[str, Any]:
    """The checkpoint at ``path``, loaded without unpickling anything but tensors and plain values."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
        why = f"it pickles {found.group(1)}" if found else _one_line(err)
        raise CheckpointRefused(
            f"refusing to load {path}: it holds pickled objects that loading would execute ({why}), "
            "which rlhf_lightning's checkpoints never do; use only checkpoints written by train.py, "
            "or re-save a trusted file's state_dict with torch.save"
        ) from err
    except (RuntimeError, OSError, EOFError, ValueError) as err:
        raise CheckpointRefused(
            f"cannot read {path} ({_one_line(err)}); is it a Lightning checkpoint written by train.py?"
        ) from err
    if not isinstance(state, dict):
        raise CheckpointRefused(f"{path} holds a {type(state).__name__}, not a Lightning checkpoint")
    return state


def damaged_entry(path: str | Path) -> str | None:
    """The first entry of the zip archive ``path`` whose bytes fail its CRC (None: all intact)."""
    try:
        with zipfile.ZipFile(path) as archive:
            return archive.testzip()
    except (OSError, zipfile.BadZipFile, EOFError) as err:
        return f"<the archive itself: {_one_line(err)}>"


def _float_tensors(node: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(node, torch.Tensor):
        if node.is_floating_point() or node.is_complex():
            yield prefix, node
    elif isinstance(node, dict):
        for k, v in node.items():
            yield from _float_tensors(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            yield from _float_tensors(v, f"{prefix}[{i}]")


FINITE_CHUNK = 1 << 22  # elements checked at once: the check's scratch memory stays a few MB


def all_finite(t: torch.Tensor) -> bool:
    """Whether every value of the floating (or complex) tensor ``t`` is finite, read in chunks of
    at most :data:`FINITE_CHUNK` elements (a memory-mapped weight is paged in once, and the
    check's boolean scratch never grows to the tensor's size); stops at the first bad chunk."""
    flat = t.reshape(-1) if t.is_contiguous() else t.flatten()  # a view of a saved (contiguous) tensor
    return all(bool(torch.isfinite(chunk).all()) for chunk in flat.split(FINITE_CHUNK))  # at load only


def nonfinite_tensors(state: dict[str, Any]) -> list[str]:
    """The names of the weights (``state_dict``) and optimizer state tensors holding a NaN or inf
    (floating and complex tensors only: integer ones cannot)."""
    return [
        name
        for section in ("state_dict", "optimizer_states")
        for name, t in _float_tensors(state.get(section), section)
        if not all_finite(t)
    ]


def verify_checkpoint(path: str | Path) -> dict[str, Any]:
    """The checkpoint at ``path`` (as :func:`load_checkpoint`), its bytes and values checked first."""
    damaged = damaged_entry(path)
    if damaged is not None:
        raise CheckpointRefused(
            f"{path} is damaged: its entry {damaged} fails the archive's CRC check (the file changed "
            "after it was written: a disk or copy error); resume from another checkpoint of the run"
        )
    state = load_checkpoint(path)
    bad = nonfinite_tensors(state)
    if bad:
        shown = ", ".join(bad[:3]) + (f" ... ({len(bad)} in all)" if len(bad) > 3 else "")
        raise CheckpointRefused(
            f"{path} holds NaN or inf values in {shown}: the run had diverged when it saved, or the "
            "file is damaged; resume from an earlier checkpoint of the run"
        )
    return state
