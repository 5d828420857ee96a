"""The CLI end to end: train.py runs, sweeps, resumes, exports adapters, logs to every logger."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import PeftModel

from rlhf_lightning.models.build import load_model
from tests.cli_zygote import run_cli
from tests.conftest import FAST, ROOT, compose_config

pytestmark = pytest.mark.slow


def train(*args: str, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "HYDRA_FULL_ERROR": "1"}
    proc = run_cli([sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def read_metrics(run_dir: Path) -> list[dict[str, str]]:
    return list(csv.DictReader((run_dir / "metrics.csv").open()))


def test_default_run_logs_eval_before_and_after_and_exports_adapter(tmp_path):
    out = tmp_path / "run"
    train(*FAST, "trainer.max_steps=3", "checkpoint.every_n_steps=2", f"output_dir={out}", cwd=tmp_path)
    rows = read_metrics(out)
    evals = [
        (int(r["step"]), float(r["eval/accuracy_greedy"])) for r in rows if r.get("eval/accuracy_greedy")
    ]
    assert [s for s, _ in evals] == [0, 2, 3]  # before the first update, every 2 steps, at the end
    assert all(r.get("eval/accuracy_sampled") for r in rows if r.get("eval/accuracy_greedy"))
    train_rows = [r for r in rows if r.get("rollout/reward_mean")]
    assert [int(r["step"]) for r in train_rows] == [1, 2, 3]
    for key in (
        "actor/loss",
        "actor/clipfrac",
        "actor/grad_norm",
        "perf/step_s",
        "perf/tokens_per_s",
        "rollout/completion_len",
    ):
        assert train_rows[0][key] != "", key
    assert (out / "samples.md").read_text().count("## step") == 3
    ckpts = out / "checkpoints"
    assert (ckpts / "last.ckpt").is_file() and (ckpts / "step_000002.ckpt").is_file()
    adapter = ckpts / "adapters" / "step_000003" / "actor"
    base = load_model(compose_config().model.path, dtype="float32")
    peft_model = PeftModel.from_pretrained(base, str(adapter))
    assert any("lora_" in n for n, _ in peft_model.named_parameters())
    state = torch.load(ckpts / "last.ckpt", weights_only=False)
    assert state["state_dict"] and all("lora_" in k for k in state["state_dict"])  # trainable weights only


def test_resume_continues_from_the_last_checkpoint(tmp_path):
    first = tmp_path / "outputs" / "resume" / "a"
    train(*FAST, "trainer.max_steps=2", f"output_dir={first}", cwd=tmp_path)
    # resume=true with output_dir: that run, continued in its own directory and metrics.csv
    proc = train(*FAST, "trainer.max_steps=4", "resume=true", f"output_dir={first}", cwd=tmp_path)
    assert f"resuming from {first / 'checkpoints' / 'last.ckpt'}" in proc.stdout + proc.stderr
    rows = read_metrics(first)
    steps = [int(r["step"]) for r in rows if r.get("rollout/reward_mean")]
    assert steps == [1, 2, 3, 4]  # continued after step 2, no eval-before-training on resume
    explicit = tmp_path / "outputs" / "resume" / "c"
    train(
        *FAST,
        "trainer.max_steps=5",
        f"ckpt_path={first / 'checkpoints' / 'last.ckpt'}",  # step 4 now
        f"output_dir={explicit}",
        cwd=tmp_path,
    )
    assert sorted({int(r["step"]) for r in read_metrics(explicit) if r.get("rollout/reward_mean")}) == [5]


def test_multirun_sweeps_each_job_in_its_own_dir(tmp_path):
    train("-m", "algo=grpo,cispo", *FAST, "trainer.max_steps=1", "name=sweep", cwd=tmp_path)
    jobs = sorted((tmp_path / "outputs" / "sweep" / "multirun").glob("*/*/metrics.csv"))
    assert len(jobs) == 2
    names = {p.parent.name for p in jobs}
    assert any("algo=grpo" in n for n in names) and any("algo=cispo" in n for n in names)


def test_wandb_offline_runs_do_not_bleed_across_multirun_jobs(tmp_path):
    pytest.importorskip("wandb")
    train("-m", "algo=grpo,cispo", "logger=wandb", *FAST, "trainer.max_steps=1", "name=wb", cwd=tmp_path)
    runs = sorted((tmp_path / "outputs" / "wb" / "multirun").glob("*/*/wandb/offline-run-*"))
    assert len(runs) == 2 and len({r.name for r in runs}) == 2


def test_tensorboard_logger(tmp_path):
    out = tmp_path / "tb"
    train(*FAST, "trainer.max_steps=1", "logger=tensorboard", f"output_dir={out}", cwd=tmp_path)
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert (out / "metrics.csv").is_file()


def test_bad_value_fails_fast_with_one_clear_message(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = run_cli([sys.executable, str(ROOT / "train.py"), "algo.group_size=1"], cwd=tmp_path, env=env)
    assert proc.returncode != 0
    assert "invalid config: algo.group_size=1: at least 2" in proc.stderr
