"""Which ranks check the run directory (and a resume's checkpoint): rank 0 always; the ranks
Lightning's launcher starts from rank 0 are handed its directory and skip the checks; the ranks an
external launcher starts (torchrun, srun: all at once, with RANK/LOCAL_RANK set on every one)
check for themselves, so a refusal ends every rank instead of leaving the others waiting at the
first collective. And what the refusal suggests fits what the directory holds."""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import pytest

from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.run import fit
from rlhf_lightning.run.factories import build, run_callbacks
from rlhf_lightning.run.rundir import HANDED_DIR, RUN_MARKS, holds_run, refuse_reuse, release_run_dir
from tests.conftest import FAST, compose_config

RANK_VARS = ("RANK", "SLURM_PROCID", "LOCAL_RANK")


@pytest.fixture(autouse=True)
def launcher_env(monkeypatch):
    """No launcher's variables; the mark and ``sys.argv`` (rank 0 rewrites both) restored after."""
    for var in RANK_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(HANDED_DIR, "")  # recorded as absent: removed again after the test
    monkeypatch.delenv(HANDED_DIR)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    return monkeypatch


def earlier_run(d: Path) -> Path:
    """A directory an earlier run left: it crashed after logging, before its first checkpoint."""
    d.mkdir(parents=True)
    (d / "metrics.csv").write_text("step,rollout/reward_mean\n0,0.5\n")
    return d


def rank_0_claims(out: Path, *overrides: str) -> Path:
    claimed, _ = fit.prepare_run_dir(compose_config(list(overrides), output_dir=out))
    release_run_dir(claimed)
    return claimed


def test_every_rank_of_an_external_launcher_refuses_an_earlier_run(tmp_path, launcher_env):
    out = earlier_run(tmp_path / "run")
    for rank in ("0", "1", "3"):  # torchrun sets RANK on every rank, rank 0 included
        launcher_env.setenv("RANK", rank)
        with pytest.raises(ConfigError, match=r"output_dir=.*holds one \(metrics\.csv\)"):
            fit.prepare_run_dir(compose_config([], output_dir=out))
    launcher_env.setenv("RANK", "1")
    assert fit.prepare_run_dir(compose_config(["overwrite=true"], output_dir=out))[0] == out  # told to


def test_ranks_lightning_starts_are_handed_rank_0s_directory(tmp_path, launcher_env):
    out = tmp_path / "run"
    assert rank_0_claims(out) == out
    (out / "metrics.csv").write_text("step\n")  # rank 0 logs before the other ranks get here
    launcher_env.setenv("LOCAL_RANK", "1")  # what Lightning's launcher adds to rank 0's environment
    assert fit.prepare_run_dir(compose_config([], output_dir=out)) == (out, None)
    elsewhere = earlier_run(tmp_path / "elsewhere")  # the mark is for rank 0's directory only
    with pytest.raises(ConfigError, match="holds one"):
        fit.prepare_run_dir(compose_config([], output_dir=elsewhere))


def test_only_ranks_not_handed_the_directory_verify_a_resumes_checkpoint(tmp_path, launcher_env):
    ckpt = tmp_path / "earlier" / "checkpoints" / "step_000001.ckpt"
    ckpt.parent.mkdir(parents=True)
    ckpt.write_bytes(b"verified by the stand-in below")
    verified = []
    launcher_env.setattr(fit, "verified_checkpoint", lambda field, path: verified.append(path))
    out = tmp_path / "run"
    rank_0_claims(out, f"ckpt_path={ckpt}")
    assert verified == [str(ckpt)]
    launcher_env.setenv("LOCAL_RANK", "1")  # started by Lightning after rank 0 verified the file
    fit.prepare_run_dir(compose_config([f"ckpt_path={ckpt}"], output_dir=out))
    assert verified == [str(ckpt)]
    launcher_env.delenv(HANDED_DIR)  # started by torchrun: it reads the file for itself
    launcher_env.setenv("RANK", "1")
    fit.prepare_run_dir(compose_config([f"ckpt_path={ckpt}"], output_dir=out))
    assert verified == [str(ckpt)] * 2


def test_rank_0_writes_no_runs_mark_before_the_process_group_starts(tmp_path):
    """Why an external launcher's ranks all see the same directory: rank 0 writes none of
    RUN_MARKS until the trainer starts its process group, which waits for every rank (and every
    rank checks before it gets there)."""
    cfg = compose_config([*FAST, "num_threads=1"], output_dir=tmp_path / "run")
    out, _ = fit.prepare_run_dir(cfg)
    try:
        build(cfg, out)  # the model, the engine, the data
        loggers = fit.run_loggers(cfg, out, None)
        cbs = run_callbacks(cfg, out, [fit.SaveRunConfig(cfg, out)])
        L.Trainer(max_steps=1, logger=loggers, callbacks=cbs.all, default_root_dir=str(out))
        assert not holds_run(out), [n for n in RUN_MARKS if (out / n).exists()]
    finally:
        release_run_dir(out)


def test_the_refusal_suggests_resume_only_where_there_is_a_checkpoint_to_resume(tmp_path):
    crashed = earlier_run(tmp_path / "crashed")
    with pytest.raises(ConfigError) as refused:
        refuse_reuse(crashed, overwrite=False)
    message = str(refused.value)
    assert "resume=true" not in message
    assert f"no {crashed / 'checkpoints' / 'last.ckpt'} to resume" in message and "overwrite=true" in message

    (crashed / "checkpoints").mkdir()
    (crashed / "checkpoints" / "step_000001.ckpt").write_bytes(b"")  # not what resume=true loads
    with pytest.raises(ConfigError, match=r"no .*last\.ckpt to resume") as refused:
        refuse_reuse(crashed, overwrite=False)
    assert "resume=true" not in str(refused.value)

    (crashed / "checkpoints" / "last.ckpt").write_bytes(b"")
    with pytest.raises(ConfigError, match="continue it with resume=true, or pass overwrite=true"):
        refuse_reuse(crashed, overwrite=False)
