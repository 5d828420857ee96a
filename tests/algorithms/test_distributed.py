"""Two CPU processes (gloo) train exactly like one process on the same global batch, under
DDP and under FSDP2 (``strategy=fsdp``: sharded layers, lockstep micro-batches).

Each case runs ``ddp_worker.py`` once with 1 process and once with 2, on the same data, and
compares every trainable parameter after the update. Every case of the module runs in two
launches (``tests/torchrun_jobs.py``: the one-process runs, then the two-process runs), so the
ranks' start-up is paid once. A hang fails by timeout, not by hanging CI.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tests.conftest import FAST, compose_config
from tests.torchrun_jobs import launch

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group(name="distributed")]

BASE = [o for o in FAST if not o.startswith("algo.")]
GRPO_8x4 = [*BASE, "algo.prompts_per_step=8", "algo.group_size=4"]


@dataclass(frozen=True)
class Run:
    """One ddp_worker run: overrides, processes, strategy, steps, and its data: ``trajectories``
    (the fixture's), ``flat_then_real`` (step 1 all rewards 1, step 2 the real ones) or None
    (an offline family's own rows)."""

    overrides: tuple[str, ...]
    devices: int
    strategy: str = "ddp"
    steps: int = 1
    data: str | None = "trajectories"


RUNS: list[Run] = []  # every run of the module: registered at import, run by one fixture


def pair(overrides: list[str], strategy: str = "ddp", steps: int = 1, data: str | None = "trajectories"):
    """The one-process and the two-process run of a case."""
    runs = Run(tuple(overrides), 1, "ddp", steps, data), Run(tuple(overrides), 2, strategy, steps, data)
    RUNS.extend(r for r in runs if r not in RUNS)
    return runs


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


# ---------------------------------------------------------------- the cases
AGG_CASES = [
    ("token_mean", "ddp"),
    ("seq_mean_token_mean", "ddp"),
    ("seq_mean_token_sum_norm", "ddp"),
    ("token_mean", "fsdp"),
    ("seq_mean_token_sum_norm", "fsdp"),
]
AGG = {
    case: pair(
        [
            *GRPO_8x4,
            "algo.micro_batch_size=4",  # global: 2 per rank, 4 in the one-process run
            f"algo.loss_agg_mode={case[0]}",
            # Adam's first step moves a weight by ~lr * g / (|g| + eps): float noise in a gradient
            # near eps shows up as up to ~lr * noise / (4 eps), so the step is kept small here.
            "algo.lr=1e-5",
        ],
        case[1],
    )
    for case in AGG_CASES
}
TOKEN_BUDGET = {
    strategy: (
        pair([*GRPO_8x4, "algo.lr=1e-5", "algo.micro_batch_size=4"])[0],
        pair([*GRPO_8x4, "algo.lr=1e-5", "algo.micro_batch_tokens=90"], strategy)[1],
    )
    for strategy in ("ddp", "fsdp")
}
OFFLINE = {
    (family, strategy): pair(
        [
            *BASE,
            f"algo={family}",
            "algo.batch_size=8",
            "algo.micro_batch_size=2",
            "algo.env_eval=false",
            "algo.lr=1e-5",
        ],
        strategy,
        data=None,
    )
    for family in ("sft", "dpo")
    for strategy in ("ddp", "fsdp")
}
NO_GRAD = pair([*GRPO_8x4, "algo.lr=1e-5", "algo.weight_decay=0.1"], steps=2, data="flat_then_real")
PPO_WARMUP = pair(
    [
        *GRPO_8x4,
        "algo=ppo",
        "algo.critic_warmup_steps=10",
        "algo.lr=1e-5",
        "algo.weight_decay=0.01",
        # The critic's first LoRA gradients are ~1e-8 (its B starts at 0), where Adam's step
        # lr * m / (sqrt(v) + eps) turns the reduction order's float noise into ~lr: a larger
        # eps keeps the comparison about the update rule, not about float summation order.
        "algo.adam_eps=1e-6",
    ],
    steps=15,
)


# ---------------------------------------------------------------- the runs, once
@pytest.fixture(scope="session")  # once per test process, however xdist orders the module's tests
def results(tmp_path_factory) -> dict[Run, dict]:
    """Every run of :data:`RUNS`, in one launch per number of processes. The data: 32
    trajectories (8 prompts x 4) from the tiny model whose last 4 groups (rank 1's share with 2
    processes) have equal rewards, so that rank skips every row; and the same 32 with every
    reward 1 (every GRPO advantage 0: no row trains, no parameter gets a gradient anywhere)."""
    from rlhf_lightning.run import build

    tmp = tmp_path_factory.mktemp("runs")
    cfg = compose_config(GRPO_8x4, output_dir=tmp / "build")
    torch.manual_seed(0)
    module, _ = build(cfg, tmp)
    result = module.harness.rollout(module.engine, list(range(8)), module.sampling, group_size=4)
    for i, t in enumerate(result.trajectories):
        t.rewards = [1.0] if t.group_id >= 4 else [float(i % 2)]
    torch.save(result.trajectories, tmp / "trajectories.pt")
    for t in result.trajectories:
        t.rewards = [1.0]
    torch.save(result.trajectories, tmp / "flat.pt")
    data = {
        None: None,
        "trajectories": str(tmp / "trajectories.pt"),
        "flat_then_real": [str(tmp / "flat.pt"), str(tmp / "trajectories.pt")],
    }
    jobs: dict[int, list[dict]] = {1: [], 2: []}
    for i, run in enumerate(RUNS):
        spec = {
            "overrides": list(run.overrides),
            "devices": run.devices,
            "out": str(tmp / f"run{i}" / "out.pt"),
            "trajectories": data[run.data],
            "strategy": run.strategy,
            "steps": run.steps,
        }
        (tmp / f"run{i}").mkdir()
        jobs[run.devices].append({"kind": "ddp_worker", "spec": spec})
    for nproc, batch in jobs.items():
        launch(batch, nproc, tmp)
    return {run: torch.load(tmp / f"run{i}" / "out.pt", weights_only=False) for i, run in enumerate(RUNS)}


# ---------------------------------------------------------------- the checks
@pytest.mark.parametrize(("mode", "strategy"), AGG_CASES)
def test_two_ranks_update_like_one_rank(results, mode, strategy):
    one, two = (results[r] for r in AGG[mode, strategy])
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
def test_token_budget_micro_batches_on_two_ranks_update_like_fixed_ones_on_one(results, strategy):
    """``algo.micro_batch_tokens``: each rank packs its own rows (FSDP: the ranks agree on the
    count, the shorter one pads with zero-weight passes), the update is the fixed-size one."""
    one, two = (results[r] for r in TOKEN_BUDGET[strategy])
    assert two["world"] == 2 and two["sharded"] == (strategy == "fsdp")
    assert one["metrics"]["actor/grad_norm"] > 0
    assert_same_update(one, two)


@pytest.mark.parametrize("family", ["sft", "dpo"])
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_offline_two_ranks_update_like_one_rank(results, family, strategy):
    one, two = (results[r] for r in OFFLINE[family, strategy])
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


def test_a_parameter_without_gradient_on_every_rank_is_not_stepped(results):
    """Step 1 has no gradient anywhere (all advantages 0), step 2 a real one. One process skips
    step 1 in AdamW (no state, no decay); two processes must too: zeros in place of missing
    gradients would count a step (bias correction) and decay the weights."""
    one, two = (results[r] for r in NO_GRAD)
    steps = {float(s["step"]) for s in one["adam"].values()}
    assert steps == {1.0}, steps  # one process: only step 2 counted
    assert adam_state_diff(one, two) <= 1e-6
    assert max_param_diff(one, two) <= 1e-7


def test_ppo_critic_warmup_two_ranks_like_one_over_15_steps(results):
    """PPO's default critic warm-up (10 steps without actor gradients), then 5 actor updates:
    the actor's AdamW state counts its own 5 steps on both, and every update matches."""
    one, two = (results[r] for r in PPO_WARMUP)
    actor_steps = {float(s["step"]) for n, s in one["adam"].items() if ".actor." in n}
    assert actor_steps == {5.0}, actor_steps
    assert adam_state_diff(one, two) <= 1e-6
    assert max_grad_diff(one, two) <= 1e-6
    assert max_param_diff(one, two) <= 1e-6
    assert len(one["step_metrics"]) == len(two["step_metrics"]) == 15
    for m1, m2 in zip(one["step_metrics"], two["step_metrics"]):  # the global norm, step by step
        assert m2["actor/grad_norm"] == pytest.approx(m1["actor/grad_norm"], rel=1e-5)
