"""Run directories: claimed exclusively, never shared with a live run or an earlier run's
results; resumes refused when the config changed; the signal handler's second Ctrl-C."""

from __future__ import annotations

import os
import signal
import socket

import pytest
import torch
from omegaconf import OmegaConf

from rlhf_lightning.callbacks.signals import StopOnSignal
from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.run.rundir import (
    LOCK,
    check_same_run,
    claim_run_dir,
    config_changes,
    release_run_dir,
    save_run_config,
)


def hold(path, pid: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / LOCK).write_text(f"{socket.gethostname()} {pid}")


def test_a_live_runs_directory_is_never_shared(tmp_path):
    run = tmp_path / "2026-11-30_10-00-00"
    hold(run, os.getppid())  # a live process holds it
    assert claim_run_dir(run, explicit=False) == tmp_path / "2026-11-30_10-00-00_1"
    with pytest.raises(ConfigError, match=r"output_dir=.*a directory no live run uses"):
        claim_run_dir(run, explicit=True)


def test_a_killed_runs_lock_is_taken_over_and_released(tmp_path):
    run = tmp_path / "run"
    hold(run, 2**22 + 12345)  # no such process
    assert claim_run_dir(run, explicit=True) == run
    assert (run / LOCK).read_text() == f"{socket.gethostname()} {os.getpid()}"
    release_run_dir(run)
    assert not (run / LOCK).exists()


def test_a_timestamped_directory_with_an_earlier_run_is_not_reused(tmp_path):
    run = tmp_path / "stamp"
    run.mkdir()
    save_run_config(OmegaConf.create({"a": 1}), run)
    assert claim_run_dir(run, explicit=False) == tmp_path / "stamp_1"
    assert claim_run_dir(run, explicit=True) == run  # named by the user: reuse (e.g. resume)


def test_resume_refuses_a_changed_config_naming_the_keys(tmp_path):
    saved = OmegaConf.create(
        {"algo": {"lr": 1e-4, "beta": 0.0}, "trainer": {"max_steps": 10}, "output_dir": "a"}
    )
    save_run_config(saved, tmp_path)
    longer = OmegaConf.merge(saved, {"trainer": {"max_steps": 20}, "output_dir": "b"})
    assert config_changes(saved, longer) == []  # safe to change
    check_same_run(longer, tmp_path, force=False)
    changed = OmegaConf.merge(saved, {"algo": {"lr": 0.5}})
    with pytest.raises(ConfigError, match=r"algo.lr: 0.0001 -> 0.5.*resume_force=true"):
        check_same_run(changed, tmp_path, force=False)
    check_same_run(changed, tmp_path, force=True)


def test_second_ctrl_c_interrupts_at_once():
    cb = StopOnSignal("unused")
    cb._handle(signal.SIGINT, None)
    assert cb.received == signal.SIGINT
    with pytest.raises(KeyboardInterrupt):
        cb._handle(signal.SIGINT, None)


def test_a_nonfinite_gradient_step_is_skipped_and_counted(tmp_path):
    from rlhf_lightning.run import build
    from tests.conftest import FAST, compose_config

    cfg = compose_config(FAST)
    module, _ = build(cfg, tmp_path)
    params = module.policy.trainable_parameters()
    for p in params:
        p.grad = torch.ones_like(p)
    params[0].grad[0] = float("nan")
    health = module.guard_records()[0]
    health.skip_if_nonfinite([torch.tensor(float("nan"))], params, counted=True)
    assert all(p.grad is None for p in params)  # AdamW leaves the weights as they are
    assert module.nonfinite_streak == 1 and module.skipped_steps == 1
    health.skip_if_nonfinite([torch.tensor(2.0)], params, counted=True)
    assert module.nonfinite_streak == 0 and module.skipped_steps == 1
