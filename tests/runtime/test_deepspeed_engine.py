"""DeepSpeed's engine with the project's settings, on the CPU (DS_ACCELERATOR=cpu, gloo): several
backward passes then one step equal one plain optimizer step on the summed gradients, clipped
by ``algo.grad_clip``. Skipped where deepspeed is not installed (it is optional)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytest.importorskip("deepspeed")

SCRIPT = r"""
import argparse, copy, json, os, sys
import torch, deepspeed
from rlhf_lightning.runtime.deepspeed import before_backward, deepspeed_config

stage, optim, clip = int(sys.argv[1]), sys.argv[2], float(sys.argv[3]) if sys.argv[3] != "none" else None
torch.manual_seed(0)
deepspeed.init_distributed("gloo")
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
for p in model[0].parameters():
    p.requires_grad_(False)  # a frozen base under trainable weights
ref = copy.deepcopy(model)
batches = [torch.randn(5, 8) for _ in range(3)]  # three backward passes, one optimizer step


def make(params):
    return torch.optim.AdamW(params, lr=0.1) if optim == "adamw" else torch.optim.SGD(params, lr=0.5)


opt = make([p for p in ref.parameters() if p.requires_grad])
for x in batches:
    (ref(x) ** 2).mean().backward()
trainable = [p for p in ref.parameters() if p.requires_grad]
norm = float(torch.nn.utils.clip_grad_norm_(trainable, clip if clip is not None else float("inf")))
opt.step()

config = {**deepspeed_config(stage, clip, False), "gradient_accumulation_steps": 1}  # Lightning adds it
engine, _, _, _ = deepspeed.initialize(
    args=argparse.Namespace(device_rank=0), config=config, model=model,
    model_parameters=[p for p in model.parameters() if p.requires_grad],
    optimizer=make([p for p in model.parameters() if p.requires_grad]), dist_init_required=False,
)
for x in batches:
    loss = (engine.module(x) ** 2).mean()  # through the module, as the learner does
    before_backward(engine)
    engine.backward(loss)
engine.step()
with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
    diff = max(float((a - b).abs().max()) for a, b in zip(engine.module.parameters(), ref.parameters()))
print(json.dumps({"norm": float(engine.get_global_grad_norm()), "ref_norm": norm, "param_diff": diff}))
"""


@pytest.mark.parametrize(
    ("stage", "optim", "clip"), [(2, "adamw", None), (3, "adamw", None), (2, "sgd", 0.05), (3, "sgd", 0.05)]
)
def test_backward_passes_accumulate_and_deepspeed_clips_like_one_plain_step(stage, optim, clip, tmp_path):
    env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(29400 + stage * 10 + (optim == "sgd")),
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
    }
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(stage), optim, str(clip) if clip is not None else "none"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # the gradient of the step is the sum over the three passes, not the last pass alone
    assert out["norm"] == pytest.approx(out["ref_norm"], rel=1e-5)
    assert out["param_diff"] < 1e-6


def test_the_strategy_takes_its_config_and_never_enters_no_sync():
    """Lightning refuses a DeepSpeed config that sets gradient_accumulation_steps, and ZeRO-2/3
    refuse ``engine.no_sync()`` (Lightning's block_backward_sync would enter it)."""
    from types import SimpleNamespace

    from rlhf_lightning.runtime.strategies import build_strategy
    from tests.conftest import compose_config

    strategy = build_strategy(compose_config(["strategy=deepspeed_zero2"]).strategy, grad_clip=0.7)

    class Engine:
        def no_sync(self):
            raise AssertionError("ZeRO-2 refuses no_sync()")

    strategy.model = Engine()
    with strategy.block_backward_sync():
        pass
    trainer = SimpleNamespace(accumulate_grad_batches=1, gradient_clip_val=None)
    strategy._lightning_module = SimpleNamespace(trainer=trainer)
    strategy._format_batch_size_and_grad_accum_config()  # raised with the key set
    assert strategy.config["gradient_accumulation_steps"] == 1
    assert (
        strategy.config["gradient_clipping"] == 0.7
        and strategy.config["managed_gradient_accumulation"] is False
    )
