"""Grouped mixed-adapter LoRA batches by slices: the runs, and the same numbers as PEFT's path."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import layer as lora_layer

from rlhf_lightning.models.mixed_lora import adapter_runs, grouped_mixed_batches


def test_adapter_runs_by_hand():
    assert adapter_runs(["a", "a", "b", "c", "c", "c"]) == [("a", 0, 2), ("b", 2, 3), ("c", 3, 6)]
    assert adapter_runs(["a"]) == [("a", 0, 1)]
    assert adapter_runs([]) == []
    assert adapter_runs(["a", "b", "a"]) is None  # a's rows are split: PEFT's own path


def two_adapter_model():
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 4)).double()
    model = get_peft_model(base, LoraConfig(r=2, lora_alpha=4, target_modules=["0", "2"]), adapter_name="m0")
    model.add_adapter("m1", LoraConfig(r=2, lora_alpha=4, target_modules=["0", "2"]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn_like(p))
    return model.eval()


@pytest.mark.parametrize(
    "names", [["m0", "m0", "m1", "m1", "m1"], ["m1", "m0", "m0", "__base__", "__base__"]]
)
def test_grouped_rows_take_slices_and_give_what_each_adapter_gives_alone(names, monkeypatch):
    model = two_adapter_model()
    x = torch.randn(len(names), 3, 6, dtype=torch.float64)
    calls = []
    original = lora_layer.Linear._mixed_batch_forward
    monkeypatch.setattr(
        lora_layer.LoraLayer, "_mixed_batch_forward", lambda *a, **k: calls.append(1) or original(*a, **k)
    )
    with torch.no_grad(), grouped_mixed_batches():
        got = model(x, adapter_names=names)
    assert not calls  # the slices path, not PEFT's per-row one
    with torch.no_grad():
        for i, name in enumerate(names):
            if name == "__base__":
                with model.disable_adapter():
                    want = model(x[i : i + 1])
            else:
                model.set_adapter(name)
                want = model(x[i : i + 1])
            torch.testing.assert_close(got[i : i + 1], want, atol=1e-12, rtol=0)
    assert "_mixed_batch_forward" not in lora_layer.Linear.__dict__  # the patch is undone


def test_split_rows_fall_back_to_peft():
    model = two_adapter_model()
    x = torch.randn(3, 2, 6, dtype=torch.float64)
    names = ["m0", "m1", "m0"]
    with torch.no_grad():
        want = model(x, adapter_names=names)
        with grouped_mixed_batches():
            got = model(x, adapter_names=names)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
