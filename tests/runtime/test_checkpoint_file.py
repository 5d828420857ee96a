"""A resume's check for NaN and inf in a checkpoint reads each tensor in bounded chunks (its
scratch never grows to a weight's size) and still finds a bad value anywhere in it."""

from __future__ import annotations

import torch

from rlhf_lightning.runtime import checkpoint_file
from rlhf_lightning.runtime.checkpoint_file import nonfinite_tensors


def test_nonfinite_values_are_found_chunk_by_chunk(monkeypatch):
    monkeypatch.setattr(checkpoint_file, "FINITE_CHUNK", 8)
    seen: list[int] = []
    isfinite = torch.isfinite

    def counting_isfinite(t: torch.Tensor) -> torch.Tensor:
        seen.append(t.numel())
        return isfinite(t)

    monkeypatch.setattr(torch, "isfinite", counting_isfinite)
    last_nan = torch.zeros(10, 10)
    last_nan[9, 9] = float("nan")  # in the last chunk only
    transposed_inf = torch.zeros(6, 5).t()  # not contiguous
    transposed_inf[4, 0] = float("inf")
    state = {
        "state_dict": {
            "fine": torch.ones(40),
            "last_nan": last_nan,
            "transposed_inf": transposed_inf,
            "steps": torch.full((20,), 2**62, dtype=torch.int64),  # an integer tensor: never checked
            "half_inf": torch.tensor([1.0, float("-inf")], dtype=torch.float16),
        },
        "optimizer_states": [
            {"state": {0: {"exp_avg": torch.zeros(3), "exp_avg_sq": torch.tensor([float("nan")])}}}
        ],
    }
    assert nonfinite_tensors(state) == [
        "state_dict.last_nan",
        "state_dict.transposed_inf",
        "state_dict.half_inf",
        "optimizer_states[0].state.0.exp_avg_sq",
    ]
    assert seen and max(seen) <= 8  # no boolean scratch beyond one chunk
    assert sum(seen) == 40 + 100 + 30 + 2 + 3 + 1  # every float value read once, integers never
