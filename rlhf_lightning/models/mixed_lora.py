"""Mixed-adapter LoRA batches whose rows come grouped by adapter, at the cost of slices.

PEFT runs a batch with one adapter per row (``adapter_names=[...]``) by building, in every LoRA
layer of every forward, a Python list of each adapter's row indices and gathering and scattering
rows through it. When each adapter's rows are contiguous (a population's rollout: member by
member) the same sums are slices: ``x[s:e]`` is a view, ``result[s:e] +=`` adds in place, and the
runs are found once per distinct ``adapter_names`` list (PEFT's generate hands every decoding
step the same list). Every row still gets ``base(x) + B(A(x)) * scaling`` of its own adapter
alone, the numbers PEFT's path computes. Anything else (rows not grouped, a LoRA variant such as
DoRA, aLoRA offsets) goes through PEFT's own path.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from peft.tuners.lora import layer as lora_layer


def adapter_runs(names: Sequence[str]) -> list[tuple[str, int, int]] | None:
    """Each adapter's ``(name, start, end)`` when its rows are contiguous, in row order; None when
    some adapter's rows are split."""
    runs, start = [], 0
    for name, group in itertools.groupby(names):
        end = start + sum(1 for _ in group)
        runs.append((name, start, end))
        start = end
    return runs if len({r[0] for r in runs}) == len(runs) else None


@contextmanager
def grouped_mixed_batches() -> Iterator[None]:
    """Inside, LoRA ``Linear`` layers run grouped mixed-adapter batches by slices (see above).
    For generation (no gradients); the patch is undone on exit."""
    original = lora_layer.Linear._mixed_batch_forward
    own = lora_layer.Linear.__dict__.get("_mixed_batch_forward")
    seen: dict[int, tuple[Sequence[str], list[tuple[str, int, int]] | None]] = {}

    def forward(
        self: Any, x: torch.Tensor, *args: Any, adapter_names: Sequence[str], **kwargs: Any
    ) -> torch.Tensor:
        entry = seen.get(id(adapter_names))
        if entry is None or entry[0] is not adapter_names:
            entry = seen[id(adapter_names)] = (adapter_names, adapter_runs(adapter_names))
        runs = entry[1]
        variants = getattr(self, "lora_variant", {})
        if runs is None or kwargs.get("alora_offsets") is not None or any(n in variants for n, _, _ in runs):
            return original(self, x, *args, adapter_names=list(adapter_names), **kwargs)
        kwargs.pop("alora_offsets", None)  # PEFT's variant keyword, never the base layer's
        result = self.base_layer(x, *args, **kwargs)
        for name, start, end in runs:
            if name not in self.lora_A:  # "__base__", or an adapter this layer does not have
                continue
            lora_a, lora_b = self.lora_A[name], self.lora_B[name]
            sub = self.lora_dropout[name](x[start:end].to(lora_a.weight.dtype))
            result[start:end] += (lora_b(lora_a(sub)) * self.scaling[name]).to(result.dtype)
        return result

    lora_layer.Linear._mixed_batch_forward = forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        if own is None:
            del lora_layer.Linear._mixed_batch_forward
        else:
            lora_layer.Linear._mixed_batch_forward = own  # type: ignore[method-assign]
