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
    tmp_path: Path,
    name: str,
    overrides: list[str],
    devices: int,
    trajectories=None,
    strategy: str = "ddp",
    steps: int = 1,
) -> dict:
    out = tmp_path / f"{name}_{devices}_{strategy}.pt"
    spec = {
        "overrides": overrides,
        "devices": devices,
        "out": str(out),
        "trajectories": trajectories,
        "strategy": strategy,
        "steps": steps,
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


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_token_budget_micro_batches_on_two_ranks_update_like_fixed_ones_on_one(
    tmp_path, trajectories, strategy
):
    """``algo.micro_batch_tokens``: each rank packs its own rows (FSDP: the ranks agree on the
    count, the shorter one pads with zero-weight passes), the update is the fixed-size one."""
    common = [*BASE, "algo.prompts_per_step=8", "algo.group_size=4", "algo.lr=1e-5"]
    one = run_worker(tmp_path, "fixed", [*common, "algo.micro_batch_size=4"], 1, trajectories)
    two = run_worker(tmp_path, "tokens", [*common, "algo.micro_batch_tokens=90"], 2, trajectories, strategy)
    assert two["world"] == 2 and two["sharded"] == (strategy == "fsdp")
    assert one["metrics"]["actor/grad_norm"] > 0
    assert_same_update(one, two)


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


def adam_state_diff(a: dict, b: dict) -> float:
    """AdamW's per-parameter state compared by name: the same parameters have state (one never
    stepped has none) with the same ``step`` count (bias correction); returns the largest
    difference of the first moments (averages of gradients, so comparable to them)."""
    assert a["adam"].keys() == b["adam"].keys()
    diffs = [0.0]
    for name, state in a["adam"].items():
        assert float(state["step"]) == float(b["adam"][name]["step"]), name
        diffs.append(float((state["exp_avg"] - b["adam"][name]["exp_avg"]).abs().max()))
    return max(diffs)


@pytest.fixture(scope="module")
def flat_rewards(tmp_path_factory, trajectories) -> str:
    """The same 32 trajectories with every reward 1: every GRPO advantage is 0, so no row trains
    and no parameter gets a gradient on any rank."""
    items = torch.load(trajectories, weights_only=False)
    for t in items:
        t.rewards = [1.0]
    path = tmp_path_factory.mktemp("flat") / "flat.pt"
    torch.save(items, path)
    return str(path)


def test_a_parameter_without_gradient_on_every_rank_is_not_stepped(tmp_path, trajectories, flat_rewards):
    """Step 1 has no gradient anywhere (all advantages 0), step 2 a real one. One process skips
    step 1 in AdamW (no state, no decay); two processes must too: zeros in place of missing
    gradients would count a step (bias correction) and decay the weights."""
    overrides = [
        *BASE,
        "algo.prompts_per_step=8",
        "algo.group_size=4",
        "algo.lr=1e-5",
        "algo.weight_decay=0.1",
    ]
    spec = [flat_rewards, trajectories]
    one = run_worker(tmp_path, "nograd", overrides, 1, spec, steps=2)
    two = run_worker(tmp_path, "nograd", overrides, 2, spec, steps=2)
    steps = {float(s["step"]) for s in one["adam"].values()}
    assert steps == {1.0}, steps  # one process: only step 2 counted
    assert adam_state_diff(one, two) <= 1e-6
    assert max_param_diff(one, two) <= 1e-7


def test_ppo_critic_warmup_two_ranks_like_one_over_15_steps(tmp_path, trajectories):
    """PPO's default critic warm-up (10 steps without actor gradients), then 5 actor updates:
    the actor's AdamW state counts its own 5 steps on both, and every update matches."""
    overrides = [
        *BASE,
        "algo=ppo",
        "algo.prompts_per_step=8",
        "algo.group_size=4",
        "algo.critic_warmup_steps=10",
        "algo.lr=1e-5",
        "algo.weight_decay=0.01",
        # The critic's first LoRA gradients are ~1e-8 (its B starts at 0), where Adam's step
        # lr * m / (sqrt(v) + eps) turns the reduction order's float noise into ~lr: a larger
        # eps keeps the comparison about the update rule, not about float summation order.
        "algo.adam_eps=1e-6",
    ]
    one = run_worker(tmp_path, "ppo_warmup", overrides, 1, trajectories, steps=15)
    two = run_worker(tmp_path, "ppo_warmup", overrides, 2, trajectories, steps=15)
    actor_steps = {float(s["step"]) for n, s in one["adam"].items() if ".actor." in n}
    assert actor_steps == {5.0}, actor_steps
    assert adam_state_diff(one, two) <= 1e-6
    assert max_grad_diff(one, two) <= 1e-6
    assert max_param_diff(one, two) <= 1e-6
    assert len(one["step_metrics"]) == len(two["step_metrics"]) == 15
    for m1, m2 in zip(one["step_metrics"], two["step_metrics"]):  # the global norm, step by step
        assert m2["actor/grad_norm"] == pytest.approx(m1["actor/grad_norm"], rel=1e-5)
