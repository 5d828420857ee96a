"""FSDP2 (``strategy=fsdp``) for the policy: which modules are sharded, and when the full
weights are gathered.

Layout: every decoder layer of the actor's CausalLM (LoRA layers included: FSDP2 shards frozen
and trainable parameters of one layer together) is its own ``fully_shard`` unit, and the decoder
body (embeddings, final norm) is the root unit. An untied lm head and PPO's value head stay
replicated: the policy reads the head's weight outside any module's forward (the chunked
log-prob op never builds full logits), and both are small next to the layers.

Under FSDP2 every sharded forward is a collective. Rollouts sample a different number of tokens
and turns on every rank, so generation and the no-grad passes run inside :func:`gathered`: the
weights are all-gathered once (every rank, together), those passes are local, and the weights
are sharded again before the update, whose forward/backward passes every rank runs in lockstep
(``RolloutModule.update`` pads with zero-weight micro-batches).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


def fsdp_modules(module: nn.Module) -> list[Any]:
    """The ``fully_shard`` units inside ``module``, outermost first."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def is_sharded(module: nn.Module) -> bool:
    return bool(fsdp_modules(module))


def shard_causal_lm(lm: nn.Module, mesh: Any) -> None:
    """``fully_shard`` each decoder layer of ``lm``, then its decoder body as the root unit.

    The root keeps its weights gathered after a forward (the lm head, tied to the embeddings in
    most small models, is read after the body returns); the layers reshard after theirs.
    """
    from torch.distributed.fsdp import fully_shard

    body = lm.get_decoder()  # type: ignore[operator]
    layers = getattr(body, "layers", None)
    if layers is None:
        raise TypeError(f"FSDP: {type(body).__name__} has no .layers to shard; strategy=ddp works for it")
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(body, mesh=mesh, reshard_after_forward=False)
    body._fsdp_root = True  # type: ignore[union-attr]  # restored to keep its weights after a forward


_depth: dict[int, int] = {}


@contextmanager
def gathered(module: nn.Module) -> Iterator[None]:
    """The full weights of every FSDP unit in ``module`` for the duration (a no-op unsharded).

    Entering all-gathers every unit, so every rank must enter together; nested entries (a
    validation rollout inside a training step, the engine's weight sync) are free. Inside,
    forward passes are local: ranks may run any number of them.
    """
    units = fsdp_modules(module)
    key = id(module)
    if not units or _depth.get(key, 0):
        _depth[key] = _depth.get(key, 0) + 1
        try:
            yield
        finally:
            _depth[key] -= 1
        return
    _depth[key] = 1
    try:
        with torch.no_grad():
            for unit in units:
                unit.set_reshard_after_forward(False, recurse=False)
                unit.unshard()
        yield
    finally:
        _depth[key] = 0
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(not getattr(unit, "_fsdp_root", False), recurse=False)
