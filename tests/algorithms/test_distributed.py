"""Two CPU processes (gloo) train exactly like one process on the same global batch, under
DDP and under FSDP2 (``strategy=fsdp``: sharded layers, lockstep micro-batches).

Each case runs ``ddp_worker.py`` once with 1 process and once with 2, on the same data, and
compares every trainable parameter after the update. A hang fails by timeout, not by hanging CI.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import FAST, ROOT, compose_config

pytestmark = pytest.mark.slow

WORKER = ROOT / "tests" / "algorithms" / "ddp_worker.py"
BASE = [o for o in FAST if not o.startswith("algo.")]


def run_worker(
    tmp_path: Path, name: str, overrides: list[str], devices: int, trajectories=None, strategy: str = "ddp"
) -> dict:
    out = tmp_path / f"{name}_{devices}_{strategy}.pt"
    spec = {
        "overrides": overrides,
        "devices": devices,
        "out": str(out),
        "trajectories": trajectories,
        "strategy": strategy,
    }
    spec_path = tmp_path / f"{name}_{devices}_{strategy}.json"
    spec_path.write_text(json.dumps(spec))
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(spec_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out, weights_only=False)


def max_param_diff(a: dict, b: dict) -> float:
    assert a["params"].keys() == b["params"].keys() and a["params"]
    return max(float((a["params"][k] - b["params"][k]).abs().max()) for k in a["params"])


def max_grad_diff(a: dict, b: dict) -> float:
    """The gradients each optimizer step saw (averaged over ranks), compared step by step."""
    assert len(a["grads"]) == len(b["grads"]) >= 1
    diffs = []
    for ga, gb in zip(a["grads"], b["grads"]):
        assert ga.keys() == gb.keys() and ga
        diffs += [float((ga[k] - gb[k]).abs().max()) for k in ga]
    return max(diffs)


def assert_same_update(one: dict, two: dict) -> None:
    # Adam's first step is nearly sign(g) * lr, blind to the gradient's scale: compare the
    # gradients themselves too (normalisation errors change their scale).
    assert max_grad_diff(one, two) <= 1e-6
    assert max_param_diff(one, two) <= 1e-6


@pytest.fixture(scope="module")
def trajectories(tmp_path_factory) -> str:
    """32 trajectories (8 prompts x 4) from the tiny model; the last 4 groups (rank 1's share
    with 2 processes) all have equal rewards, so that rank skips every row."""
    from rlhf_lightning.run import build

    tmp = tmp_path_factory.mktemp("traj")
    cfg = compose_config([*BASE, "algo.prompts_per_step=8", "algo.group_size=4"], output_dir=tmp / "run")
    torch.manual_seed(0)
    module, _ = build(cfg, tmp)
    result = module.harness.rollout(module.engine, list(range(8)), module.sampling, group_size=4)
    for i, t in enumerate(result.trajectories):
        t.rewards = [1.0] if t.group_id >= 4 else [float(i % 2)]
    path = tmp / "trajectories.pt"
    torch.save(result.trajectories, path)
    return str(path)


@pytest.mark.parametrize(
    ("mode", "strategy"),
    [
        ("token_mean", "ddp"),
        ("seq_mean_token_mean", "ddp"),
        ("seq_mean_token_sum_norm", "ddp"),
        ("token_mean", "fsdp"),
        ("seq_mean_token_sum_norm", "fsdp"),
    ],
)
def test_two_ranks_update_like_one_rank(tmp_path, trajectories, mode, strategy):
    overrides = [
        *BASE,
        "algo.prompts_per_step=8",
        "algo.group_size=4",
        "algo.micro_batch_size=4",  # global: 2 per rank, 4 in the one-process run
        f"algo.loss_agg_mode={mode}",
        # Adam's first step moves a weight by ~lr * g / (|g| + eps): float noise in a gradient near
        # eps shows up as up to ~lr * noise / (4 eps), so the step is kept small here.
        "algo.lr=1e-5",
    ]
    one = run_worker(tmp_path, mode, overrides, 1, trajectories)
    two = run_worker(tmp_path, mode, overrides, 2, trajectories, strategy)
    assert two["world"] == 2 and one["world"] == 1
    assert two["sharded"] == (strategy == "fsdp") and not one["sharded"]
    assert one["metrics"]["actor/grad_norm"] > 0
    assert_same_update(one, two)
    # rank 1 skipped all its rows (zero advantages): the logged share is the global one
    assert two["metrics"]["actor/skipped_rows_frac"] == pytest.approx(
        one["metrics"]["actor/skipped_rows_frac"]
    )
    assert two["metrics"]["rollout/reward_mean"] == pytest.approx(one["metrics"]["rollout/reward_mean"])
    # the global gradient norm (FSDP: summed over the ranks' shards) that clipping uses
    assert two["metrics"]["actor/grad_norm"] == pytest.approx(one["metrics"]["actor/grad_norm"], rel=1e-5)


@pytest.mark.parametrize(
    "overrides",
    [
        ["algo=sft", "algo.batch_size=8", "algo.micro_batch_size=2", "algo.env_eval=false"],
        ["algo=dpo", "algo.batch_size=8", "algo.micro_batch_size=2", "algo.env_eval=false"],
    ],
    ids=["sft", "dpo"],
)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_offline_two_ranks_update_like_one_rank(tmp_path, overrides, strategy):
    overrides = [*BASE, *overrides, "algo.lr=1e-5"]  # see the note on Adam above
    one = run_worker(tmp_path, overrides[len(BASE)][5:], overrides, 1)
    two = run_worker(tmp_path, overrides[len(BASE)][5:], overrides, 2, strategy=strategy)
    assert two["sharded"] == (strategy == "fsdp")
    assert_same_update(one, two)
