"""What a run shows and hands on: the summary table and plots.png, a W&B offline run read back
record by record, Optuna sweeps through hparams_search, and resume inside a multirun."""

from __future__ import annotations

import csv
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.cli_zygote import run_cli
from tests.conftest import FAST, ROOT

pytestmark = pytest.mark.slow
QUICK = [*FAST, "samples.every_n_steps=2"]


def train(*args: str, cwd: Path, ok: bool = True, merged: bool = False) -> subprocess.CompletedProcess:
    """train.py's process; ``merged``: stderr into stdout, in the order a console shows them."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "HYDRA_FULL_ERROR": "1"}
    proc = run_cli(
        [sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, env=env, timeout=900, merged=merged
    )
    assert (proc.returncode == 0) == ok, proc.stdout[-3000:] + (proc.stderr or "")[-5000:]
    return proc


def csv_rows(run_dir: Path) -> list[dict[str, str]]:
    path = run_dir / "metrics.csv"
    return list(csv.DictReader(path.open())) if path.is_file() else []


def test_a_run_ends_with_its_summary_table_and_writes_plots_png(tmp_path):
    out = tmp_path / "run"
    proc = train(*QUICK, f"output_dir={out}", cwd=tmp_path, merged=True)
    assert (out / "plots.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    table = lines[max(i for i, line in enumerate(lines) if "run finished" in line) :]  # to the end
    assert table[1].split() == ["metric", "before", "after", "change"]
    assert any(line.startswith("eval/accuracy_sampled ") for line in table)
    text = "\n".join(table)
    assert f"plot       {out / 'plots.png'}" in text and f"metrics    {out / 'metrics.csv'}" in text
    assert table[-1].startswith("log "), table[-1]  # nothing after the table
    assert "run finished" in (out / "train.log").read_text()
    # which tuned settings applied (conf/tuned/<model>/<family>.yaml), in the log
    assert "tuned settings: conf/tuned/tiny/grpo.yaml (family grpo)" in (out / "train.log").read_text()
    assert "Tip:" not in proc.stdout and "Total FLOPs" not in proc.stdout


# ---------------------------------------------------------------- W&B offline run, read back
def wandb_records(path: Path) -> list:
    """The records of a ``.wandb`` file: W&B's 7-byte header, then LevelDB's log format (32 KiB
    blocks of records, each a 7-byte header: crc32, length, type FULL=1 FIRST=2 MIDDLE=3 LAST=4)."""
    from wandb.proto import wandb_internal_pb2

    data, block, records, pending = path.read_bytes(), 32768, [], b""
    pos = 7
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # block trailer
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(pending)
            records.append(rec)
    return records


def test_wandb_offline_run_has_sample_tables_adapters_and_hydra_overrides(tmp_path):
    pytest.importorskip("wandb")
    out = tmp_path / "wb"
    args = [*QUICK, "trainer.max_steps=4", "logger=wandb", "logger.log_model=true", f"output_dir={out}"]
    proc = train(*args, cwd=tmp_path)
    assert "W&B run: " in proc.stdout + proc.stderr
    (run_file,) = out.glob("wandb/offline-run-*/run-*.wandb")
    records = wandb_records(run_file)
    rows = []
    for r in records:
        if r.WhichOneof("record_type") == "history":
            rows.append(
                {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in r.history.item
                }
            )
    # A table (and the end's plot) is a history row of its own, at the trainer's step.
    table_steps = [row["trainer/global_step"] for row in rows if row.get("samples/_type") == "table-file"]
    assert table_steps == [2, 4], [sorted(r) for r in rows]
    assert [row["trainer/global_step"] for row in rows if row.get("plots/_type") == "image-file"] == [4]
    config = {}
    for r in records:
        if r.WhichOneof("record_type") == "config":
            config.update({item.key: json.loads(item.value_json) for item in r.config.update})
    hydra = config["hydra"]["value"] if "value" in config["hydra"] else config["hydra"]
    assert "logger=wandb" in hydra["overrides"] and hydra["multirun"] is False
    artifacts = [r.artifact for r in records if r.WhichOneof("record_type") == "artifact"]
    assert any(a.type == "model" and a.name.startswith("adapters-") for a in artifacts), artifacts
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.run_group == "default" and run.job_type == "train"
    assert list(run.tags) == ["grpo", "tiny", "arithmetic"]


# ---------------------------------------------------------------- sweeps
def test_optuna_sweep_runs_two_trials_and_reports_the_best_value(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    short = [
        "trainer.max_steps=3",
        "env.kwargs.eval_size=20",
        "eval.batch_size=20",
        "trainer.enable_progress_bar=false",
    ]
    train(
        "hparams_search=optuna",
        "hydra.sweeper.n_trials=2",
        "experiment=quick",
        *short,
        "name=opt",
        cwd=tmp_path,
    )
    (result,) = (tmp_path / "outputs" / "opt" / "multirun").glob("*/optimization_results.yaml")
    best = yaml.safe_load(result.read_text())
    assert isinstance(best["best_value"], float) and set(best["best_params"]) >= {
        "algo.lr",
        "algo.group_size",
    }
    assert len(list(result.parent.glob("*/metrics.csv"))) == 2


def test_an_optimized_metric_the_run_never_logs_fails_before_training(tmp_path):
    out = tmp_path / "never"
    proc = train(*FAST, "optimized_metric=eval/never_logged", f"output_dir={out}", cwd=tmp_path, ok=False)
    assert "optimized_metric='eval/never_logged'" in proc.stderr and "eval/accuracy_sampled" in proc.stderr
    assert not [r for r in csv_rows(out) if r.get("train/loss")]  # no training step was logged
    assert not (out / "checkpoints" / "last.ckpt").exists()


def test_resume_inside_a_multirun_continues_each_job_in_its_own_earlier_directory(tmp_path):
    sweep = ["-m", "algo.lr=1e-3,2e-3", *FAST, "name=mr", "trainer.max_steps=2", "checkpoint.every_n_steps=1"]
    train(*sweep, cwd=tmp_path)
    first = sorted((tmp_path / "outputs" / "mr" / "multirun").glob("*/*/checkpoints/last.ckpt"))
    assert len(first) == 2
    proc = train(
        *[a if a != "trainer.max_steps=2" else "trainer.max_steps=4" for a in sweep],
        "resume=true",
        cwd=tmp_path,
    )
    text = proc.stdout + proc.stderr
    for ckpt in first:
        assert f"resuming from {ckpt}" in text
        assert max(int(r["step"]) for r in csv_rows(ckpt.parent.parent) if r.get("train/loss")) == 4
