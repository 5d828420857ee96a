"""``strategy=...`` and runs with several processes: the CLI, multiruns, which rows each rank sees."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.run.validation import validate
from rlhf_lightning.runtime.strategies import build_strategy
from tests.cli_zygote import run_cli
from tests.conftest import FAST, ROOT, compose_config

DDP = ["strategy=ddp", "trainer.accelerator=cpu", "trainer.devices=2"]
FSDP = ["strategy=fsdp", "trainer.accelerator=cpu", "trainer.devices=2"]
SMALL = [
    "trainer.enable_progress_bar=false",
    "env.kwargs.eval_size=20",
    "eval.batch_size=10",
    "num_threads=1",
    "checkpoint.every_n_steps=0",
]


def test_strategy_group_builds_lightning_strategies():
    cfg = compose_config(["strategy=ddp", "strategy.timeout_s=60"])
    strategy = build_strategy(cfg.strategy)
    assert isinstance(strategy, DDPStrategy) and strategy._timeout.total_seconds() == 60
    assert build_strategy(compose_config([]).strategy) == "auto"
    fsdp = build_strategy(compose_config(["strategy=fsdp"]).strategy)
    assert isinstance(fsdp, ModelParallelStrategy) and not fsdp._save_distributed_checkpoint
    with pytest.raises(ConfigError, match=r"strategy.name='deepspeed'"):
        validate(compose_config(["strategy.name=deepspeed"]))


@pytest.mark.parametrize(
    ("overrides", "refused"),
    [
        (["model.finetune=full"], "model.finetune='full': lora with strategy=fsdp"),
        (["rollout=vllm"], "rollout.engine='vllm': hf with strategy=fsdp"),
        (["trainer.precision=16-mixed"], "trainer.precision='16-mixed'"),
    ],
)
def test_fsdp_refuses_what_it_cannot_do_at_start_up(overrides, refused):
    with pytest.raises(ConfigError, match=refused):
        validate(compose_config(["strategy=fsdp", *overrides]))
    with pytest.raises(ConfigError, match=r"algo.prompts_per_step=5: a multiple of the number of processes"):
        validate(compose_config([*DDP, "algo.prompts_per_step=5"]))


def train(tmp_path: Path, *overrides: str, multirun: bool = False, timeout: int = 600):
    cmd = [sys.executable, str(ROOT / "train.py"), *(["-m"] if multirun else []), *overrides, *SMALL]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = run_cli(cmd, cwd=tmp_path, env=env, timeout=timeout, merged=True)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return proc.stdout


def metric_rows(run_dir: Path) -> list[dict[str, str]]:
    with (run_dir / "metrics.csv").open() as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_ddp_cli_run_with_micro_batches_completes(tmp_path):
    # This command hung for 15 minutes before the update loop was rank-safe.
    out = tmp_path / "run"
    log = train(tmp_path, *DDP, "algo.micro_batch_size=2", "trainer.max_steps=3", f"output_dir={out}")
    rows = [r for r in metric_rows(out) if r.get("rollout/reward_mean")]
    assert [r["step"] for r in rows] == ["1", "2", "3"]  # logged once, by rank 0
    assert log.count("run finished") == 1
    assert "Initializing distributed: GLOBAL_RANK: 1" in log


# Runs with two processes that test what a run does (not the command line): all of them in one
# torchrun launch (tests/torchrun_jobs.py), each through rlhf_lightning.run.run as train.py would.
ALGOS = {
    "dapo": ["algo=dapo"],
    "ppo_warmup": ["algo=ppo", "algo.critic_warmup_steps=2"],
    "ppo_separate_critic_pass": [
        "algo=ppo",
        "algo.critic_warmup_steps=0",
        "algo.fuse_actor_critic_pass=false",
    ],
}
FSDP_CKPT = ["checkpoint.every_n_steps=2", "algo.micro_batch_size=2"]
POPULATION = ["population.size=2", "population.evolve_every=1", "population.eval_rows=8",
              "population.init=config", "population.selection=tournament",
    "population.resample_prob=0", "population.mutate_initial=true", "population.no_mutation_prob=0", "trainer.max_steps=4"]  # fmt: skip
RUNS = {  # name -> overrides (output_dir: <runs>/<name>); run in this order
    **{
        # 3 steps: PPO's critic warms up for 2, its actor's first update is step 3
        f"{a}_{s}": [*(DDP if s == "ddp" else FSDP), *o, "algo.prompts_per_step=8", "trainer.max_steps=3"]
        for a, o in ALGOS.items()
        for s in ("ddp", "fsdp")
    },
    "side_by_side": [*DDP, *POPULATION, "population.batched=true", "population.evolve_every=1"],
    "round_robin": [*DDP, *POPULATION, "population.batched=false", "population.evolve_every=2"],
    "fsdp_ckpt": [*FSDP, *FSDP_CKPT, "trainer.max_steps=2"],
    "fsdp_resumed": [
        *FSDP,
        *FSDP_CKPT,
        "trainer.max_steps=3",
        "ckpt_path={runs}/fsdp_ckpt/checkpoints/last.ckpt",
    ],
}


@pytest.fixture(scope="session")  # once per test process, however xdist orders the module's tests
def runs(tmp_path_factory) -> Path:
    """Every run of :data:`RUNS` and the rows each rank trains on (ddp_worker), in one launch."""
    from tests.torchrun_jobs import launch

    out = tmp_path_factory.mktemp("ddp_runs")
    jobs = [
        {"kind": "run", "spec": {"overrides": [*o, *SMALL], "output_dir": str(out / name)}}
        for name, o in RUNS.items()
    ]
    for job in jobs:
        job["spec"]["overrides"] = [o.format(runs=out) for o in job["spec"]["overrides"]]
    rows = {
        "overrides": [*FAST, "algo.prompts_per_step=8", "algo.group_size=2"],
        "devices": 2,
        "out": str(out / "rows" / "out.pt"),
        "record_rows": str(out / "rows" / "rows"),
        "steps": 2,
    }
    (out / "rows").mkdir()
    launch([*jobs, {"kind": "ddp_worker", "spec": rows}], 2, out)
    return out


@pytest.mark.slow
@pytest.mark.xdist_group(name="ddp_runs")
@pytest.mark.parametrize("algo", sorted(ALGOS))
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_dynamic_sampling_and_critic_warmup_under_ddp(runs, algo, strategy):
    steps = [r["step"] for r in metric_rows(runs / f"{algo}_{strategy}") if r.get("rollout/reward_mean")]
    assert steps == ["1", "2", "3"]


@pytest.mark.slow
@pytest.mark.xdist_group(name="ddp_runs")
def test_fsdp_checkpoint_holds_full_trainable_weights_and_resumes(runs):
    import torch

    out = runs / "fsdp_ckpt"
    state = torch.load(out / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu")
    weights = state["state_dict"]
    r = compose_config(FSDP).model.lora.r
    lora_a = [v for k, v in weights.items() if "lora_A" in k]
    assert lora_a and all(v.shape[0] == r for v in lora_a)  # whole (FSDP shards dim 0 in halves)
    assert not any("base_layer" in k for k in weights)  # trainable weights only
    adapter = out / "checkpoints" / "adapters" / "last" / "actor" / "adapter_model.safetensors"
    from safetensors.torch import load_file

    exported = load_file(str(adapter))
    assert len(exported) == len([k for k in weights if ".actor." in k])
    steps = [r["step"] for r in metric_rows(runs / "fsdp_resumed") if r.get("rollout/reward_mean")]
    assert steps == ["3"]


@pytest.mark.slow
def test_multirun_with_two_processes_runs_each_job_once(tmp_path):
    log = train(
        tmp_path,
        *DDP,
        "algo.lr=1e-3,2e-3",
        "trainer.max_steps=1",
        "eval.before_training=false",
        "name=sweep",
        multirun=True,
    )
    jobs = sorted(tmp_path.glob("outputs/sweep/multirun/*/*/metrics.csv"))
    assert len(jobs) == 2, jobs
    assert log.count("Initializing distributed: GLOBAL_RANK: 1") == 2  # one second rank per job
    assert [p.name for p in (tmp_path / "outputs" / "sweep").iterdir()] == ["multirun"]  # nothing stray
    hparams = [(j.parent / "hparams.yaml").read_text() for j in jobs]
    assert any("lr: 0.001" in h for h in hparams) and any("lr: 0.002" in h for h in hparams)


@pytest.mark.slow
@pytest.mark.xdist_group(name="ddp_runs")
def test_ranks_train_on_different_prompts_of_the_global_batch(runs):
    rank0 = json.loads((runs / "rows" / "rows.rank0.json").read_text())
    rank1 = json.loads((runs / "rows" / "rows.rank1.json").read_text())
    assert len(rank0) == len(rank1) == 2
    for a, b in zip(rank0, rank1):
        assert len(a) == len(b) == 4  # the global 8 prompts, split
        assert not set(a) & set(b)


def test_slurm_launcher_preset_composes():
    from hydra import compose, initialize_config_dir

    from tests.conftest import CONF

    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(config_name="config", overrides=["hydra/launcher=slurm"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert launcher.tasks_per_node == launcher.gpus_per_node == 8  # one task per GPU


@pytest.mark.slow
def test_sweep_through_the_submitit_launcher(tmp_path):
    train(
        tmp_path,
        "hydra/launcher=local",
        "algo.lr=1e-3,2e-3",
        "trainer.max_steps=1",
        "eval.before_training=false",
        "name=sweep",
        multirun=True,
    )
    assert len(sorted(tmp_path.glob("outputs/sweep/multirun/*/*/metrics.csv"))) == 2


@pytest.mark.slow
def test_torchrun_launches_the_ranks(tmp_path):
    out = tmp_path / "run"
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc_per_node", "2", str(ROOT / "train.py"), *DDP]
    cmd += ["trainer.max_steps=2", f"output_dir={out}", *SMALL]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    log = proc.stdout + proc.stderr
    assert "GLOBAL_RANK: 1" in log and log.count("run finished") == 1
    assert [r["step"] for r in metric_rows(out) if r.get("rollout/reward_mean")] == ["1", "2"]


@pytest.mark.slow
@pytest.mark.xdist_group(name="ddp_runs")
def test_population_side_by_side_under_ddp_ranks_agree_on_members(runs):
    """Two ranks, members side by side: each rank runs every member's update in the same order;
    after every evolution the ranks compare ids, hyper-parameters and member weights."""
    out = runs / "side_by_side"
    lineage = list(csv.DictReader((out / "lineage.csv").open()))
    assert [r["event"] for r in lineage] == ["init", "init", "elite", "clone", "elite", "clone"]
    keys = set().union(*(r for r in metric_rows(out) if any(r.values())))
    assert {"member_0/rollout/reward_mean", "member_1/rollout/reward_mean", "population/fitness_best"} <= keys
    assert [r["step"] for r in metric_rows(out) if r.get("population/steps")] == ["2", "4"]


@pytest.mark.slow
@pytest.mark.xdist_group(name="ddp_runs")
def test_population_under_ddp_ranks_agree_on_selection(runs):
    out = runs / "round_robin"
    lineage = list(csv.DictReader((out / "lineage.csv").open()))
    assert [r["event"] for r in lineage] == ["init", "init", "elite", "clone", "elite", "clone"]
    keys = set().union(*(r for r in metric_rows(out) if any(r.values())))
    assert {"member_0/reward_mean", "member_1/reward_mean", "population/fitness_best"} <= keys
