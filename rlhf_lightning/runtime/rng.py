"""Random-number state for exact resume: captured per rank into the checkpoint, restored at the
first training step after a restart, and kept out of evaluation's way (an evaluation draws
from the same generators, so without :func:`isolated` a resumed run, which skips the evaluation
that followed the checkpoint, would sample differently)."""

from __future__ import annotations

import io
import random
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, cast

import numpy as np
import torch

from rlhf_lightning.runtime.distributed import gather_objects


def _numpy_state() -> tuple[Any, ...]:
    """NumPy's global state with its key array as a tensor: checkpoints load with weights_only."""
    kind, keys, pos, has_gauss, gauss = cast(tuple[Any, ...], np.random.get_state())
    # int64, not the key's uint32: a uint32 tensor does not survive plain pickling (torch 2.13),
    # which the async rollout producer's messages use.
    return (kind, torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos), int(has_gauss), float(gauss))


def capture(generators: Mapping[str, torch.Generator] | None = None) -> dict[str, Any]:
    """This process's global RNG states (Python, NumPy, torch CPU and CUDA) and ``generators``'."""
    return {
        "python": random.getstate(),
        "numpy": _numpy_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "generators": {k: g.get_state() for k, g in (generators or {}).items()},
    }


def restore(state: Mapping[str, Any], generators: Mapping[str, torch.Generator] | None = None) -> None:
    """Put back what :func:`capture` took (a generator missing from ``state`` is left as it is)."""
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    for k, g in (generators or {}).items():
        if k in state.get("generators", {}):
            g.set_state(state["generators"][k])


def gather(state: dict[str, Any], world_size: int) -> list[dict[str, Any]]:
    """Every rank's :func:`capture` in rank order (every rank calls this). Sent as
    ``torch.save`` bytes: ``all_gather_object`` fails to unpickle tensors inside objects."""
    buf = io.BytesIO()
    torch.save(state, buf)
    blobs = gather_objects(buf.getvalue(), world_size)
    return [torch.load(io.BytesIO(b), weights_only=True) for b in blobs]


@contextmanager
def isolated() -> Iterator[None]:
    """Run a block without moving the global RNG states (evaluation between training steps)."""
    state = capture()
    try:
        yield
    finally:
        restore(state)
