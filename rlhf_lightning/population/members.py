"""A population member off the model, and the snapshots of a whole population on disk."""

from __future__ import annotations

import copy
import functools
import os
import re
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlhf_lightning.runtime.schedule import warmup_cosine

KEEP_SNAPSHOTS = 2  # background snapshots kept on disk (the newest)
SNAPSHOT_FILE = re.compile(r"snapshot_step_(\d+)\.pt")


@dataclass
class Member:
    """One member, off the model: copies of its trainable weights, its reference adapter (when
    the reference moves), its optimizer/scheduler state and the module's counters it owns."""

    id: int
    hparams: dict[str, float]
    # Round-robin populations only; members side by side keep these on the module.
    weights: list[torch.Tensor] = field(default_factory=list)
    optimizer: dict[str, Any] = field(default_factory=dict)
    scheduler: dict[str, Any] = field(default_factory=dict)
    parent: int | None = None
    fitness: float | None = None
    reference: list[torch.Tensor] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)

    def clone(self, new_id: int) -> Member:
        """An independent copy (tensors cloned, nothing shared) with a new id, parented here. It
        has no fitness of its own until it is scored (its parent's describes the parent)."""
        return Member(
            new_id,
            dict(self.hparams),
            [w.clone() for w in self.weights],
            copy.deepcopy(self.optimizer),
            copy.deepcopy(self.scheduler),
            parent=self.id,
            fitness=None,
            reference=[w.clone() for w in self.reference],
            counters=dict(self.counters),
        )


def follow_schedule(sched: Any, hp: Any, total_steps: int) -> None:
    """Make a member's ``LambdaLR`` follow ``hp``'s warm-up and cosine decay to
    ``hp.min_lr_ratio`` over ``total_steps`` of its own, from its current position: a mutated
    ``min_lr_ratio`` takes effect at the member's next step (``set_base_lrs`` then sets the
    current lr from the new multiplier)."""
    schedule = functools.partial(
        warmup_cosine, warmup_steps=hp.warmup_steps, total_steps=total_steps, min_lr_ratio=hp.min_lr_ratio
    )
    sched.lr_lambdas = [schedule] * len(sched.lr_lambdas)


def copy_into(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """Copy tensors onto tensors of the same shapes, in place (no autograd)."""
    with torch.no_grad():
        for d, s in zip(dst, src, strict=True):
            d.copy_(s)


def write_snapshot(state: dict[str, Any], path: Path, keep: int) -> None:
    """``torch.save`` to a temporary file in ``path``'s directory, then ``os.replace``: a write
    killed half-way leaves no file under the final name. Then keep the newest ``keep`` snapshots."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    prune_snapshots(path.parent, keep)


def prune_snapshots(directory: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` ``snapshot_step_N.pt`` of ``directory`` (by N); returns
    the deleted paths. Two writer threads may prune at once: a file already gone is fine."""
    found = sorted(
        (int(m.group(1)), p) for p in directory.iterdir() if (m := SNAPSHOT_FILE.fullmatch(p.name))
    )
    drop = [p for _, p in found[: max(len(found) - keep, 0)]]
    for p in drop:
        p.unlink(missing_ok=True)
    return drop
