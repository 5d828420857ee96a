"""What makes the update loop rank-safe under data parallelism (DDP), as small helpers.

Every rank runs the same sequence of collectives whatever its data:
    - gradients are averaged once per optimizer step (:func:`sync_gradients`), never inside a
      backward pass (:func:`no_backward_sync`), so ranks may run different numbers of
      micro-batches (skipped zero-advantage rows, dynamic sampling) without waiting on each other;
    - the number of optimizer steps of a training step is agreed first (:func:`agree_max`);
    - batch statistics (normalisers, advantage whitening, logged metrics) are global.
With one process every helper is the identity and costs nothing.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any, cast

import torch
import torch.distributed as dist


def is_distributed(world_size: int) -> bool:
    return world_size > 1 and dist.is_available() and dist.is_initialized()


@contextmanager
def no_backward_sync(strategy: Any) -> Iterator[None]:
    """A backward pass without DDP's own gradient all-reduce (see :func:`sync_gradients`)."""
    block = getattr(strategy, "block_backward_sync", None)
    with block() if block is not None else nullcontext():
        yield


def is_dtensor(x: Any) -> bool:
    """A sharded (FSDP2) parameter or gradient."""
    from torch.distributed.tensor import DTensor

    return isinstance(x, DTensor)


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded tensor (a view), or the tensor itself."""
    return cast(Any, t).to_local() if is_dtensor(t) else t


def sync_gradients(params: Sequence[torch.nn.Parameter], world_size: int) -> None:
    """Average the gradients of ``params`` over ranks in one flat all-reduce. Called once per
    optimizer step on every rank. Sharded parameters are left out: FSDP2 reduce-scattered
    (averaged) their gradients in the backward passes.

    A rank without a gradient for a parameter contributes zeros; a parameter that no rank has a
    gradient for keeps ``grad = None``, as it would in one process, so the optimizer skips it
    (AdamW neither counts a step nor decays it). A has-gradient flag per parameter travels in
    the same all-reduce.
    """
    params = [p for p in params if not is_dtensor(p)]
    if not is_distributed(world_size) or not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    has_grad = torch.tensor([float(p.grad is not None) for p in params], device=grads[0].device)
    flat = torch.cat([*(g.reshape(-1).float() for g in grads), has_grad])
    dist.all_reduce(flat)
    produced = flat[-len(params) :] > 0  # (n_params,) some rank had a gradient
    flat = flat[: -len(params)] / world_size
    offset = 0
    for p, keep in zip(params, produced.tolist()):
        n = p.numel()
        p.grad = flat[offset : offset + n].view_as(p).to(p.dtype).clone() if keep else None
        offset += n


def grad_norm(params: Sequence[torch.nn.Parameter], world_size: int = 1) -> torch.Tensor:
    """The global L2 norm of the parameters' gradients (0 when none has one).

    A sharded gradient (FSDP2) counts its local shard, summed over ranks; a replicated one once.
    """
    device = next((p.device for p in params), torch.device("cpu"))
    zero = torch.zeros((), device=device)
    grads = [p.grad.detach() for p in params if p.grad is not None]
    sharded = sum((local_part(g).float().square().sum() for g in grads if is_dtensor(g)), zero)
    replicated = sum((g.float().square().sum() for g in grads if not is_dtensor(g)), zero)
    if is_distributed(world_size) and any(is_dtensor(p) for p in params):
        sharded = all_sum(sharded, world_size)
    return (sharded + replicated).sqrt()


def clip_by_norm(params: Sequence[torch.nn.Parameter], max_norm: float, norm: torch.Tensor) -> None:
    """Scale the gradients so their global norm (``norm``, from :func:`grad_norm`) is at most
    ``max_norm``; works on sharded gradients (each rank scales its shard by the same factor)."""
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for p in params:
        if p.grad is not None:
            local_part(p.grad.detach()).mul_(coef.to(p.grad.device))


def agree_max(value: int, world_size: int, device: torch.device) -> int:
    """The largest ``value`` over ranks (one all-reduce)."""
    if not is_distributed(world_size):
        return value
    t = torch.tensor([value], device=device, dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def all_sum(x: torch.Tensor, world_size: int) -> torch.Tensor:
    """``x`` summed over ranks (a new tensor)."""
    if not is_distributed(world_size):
        return x
    out = x.detach().clone()
    dist.all_reduce(out)
    return out


def gather_rows(x: torch.Tensor, world_size: int, rank: int) -> tuple[torch.Tensor, int]:
    """Every rank's rows of ``x`` (any count per rank), concatenated in rank order, and where this
    rank's rows start. Shape: (n, ...) -> (N, ...)"""
    if not is_distributed(world_size):
        return x, 0
    n = torch.tensor([x.shape[0]], device=x.device, dtype=torch.long)
    sizes = [torch.zeros_like(n) for _ in range(world_size)]
    dist.all_gather(sizes, n)
    counts = [int(s.item()) for s in sizes]
    width = max(counts)
    padded = torch.zeros((width, *x.shape[1:]), dtype=x.dtype, device=x.device)
    padded[: x.shape[0]] = x
    parts = [torch.zeros_like(padded) for _ in range(world_size)]
    dist.all_gather(parts, padded)
    return torch.cat([p[:c] for p, c in zip(parts, counts)]), sum(counts[:rank])


def gather_objects(obj: Any, world_size: int) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order; every rank must call this."""
    if not is_distributed(world_size):
        return [obj]
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, obj)
    return out


def reduce_metrics(metrics: dict[str, float], world_size: int) -> dict[str, float]:
    """Metrics averaged over the ranks that logged them (``*_max`` keys: the max)."""
    if not is_distributed(world_size):
        return metrics
    gathered: list[dict[str, float] | None] = [None] * world_size
    dist.all_gather_object(gathered, metrics)
    out: dict[str, float] = {}
    for key in sorted({k for g in gathered if g for k in g}):
        values = [g[key] for g in gathered if g and key in g]
        out[key] = max(values) if key.endswith("_max") else sum(values) / len(values)
    return out
