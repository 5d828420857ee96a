"""What a run leaves and prints: checkpoints written in their own directory, a live run's files
untouched by a refused one, progress lines when stdout is no terminal, exit codes on Ctrl-C, and
sweep settings checked before the first trial."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from rlhf_lightning.callbacks.checkpoints import AtomicCheckpointIO
from rlhf_lightning.callbacks.progress import ProgressLog, auto_every, format_duration
from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.run.validation import validate
from tests.conftest import FAST, ROOT, compose_config
from tests.test_resume import rows, start, train
from tests.test_rundir import hold


def test_checkpoints_are_staged_in_their_own_directory(tmp_path, monkeypatch):
    """The temporary file lives beside the checkpoint (a rename, never a copy across
    filesystems), and a failed write leaves the previous checkpoint and no temporary file."""
    ckpt_dir = tmp_path / "run" / "checkpoints"
    staged: list[str | None] = []
    real_mkstemp = tempfile.mkstemp

    def recording(*args, **kwargs):
        staged.append(str(kwargs.get("dir")) if kwargs.get("dir") is not None else None)
        return real_mkstemp(*args, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", recording)
    io = AtomicCheckpointIO()
    io.save_checkpoint({"global_step": 1, "w": torch.ones(3)}, ckpt_dir / "last.ckpt")
    assert staged == [str(ckpt_dir)]
    assert torch.load(ckpt_dir / "last.ckpt", weights_only=True)["global_step"] == 1

    def full_disk(obj, f):
        f.write(b"PK\x03\x04 half a checkpoint")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(OSError, match="No space left"):
        io.save_checkpoint({"global_step": 2}, ckpt_dir / "last.ckpt")
    assert torch.load(ckpt_dir / "last.ckpt", weights_only=True)["global_step"] == 1
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["last.ckpt"]


@pytest.mark.slow
def test_the_trainer_saves_through_the_atomic_checkpoint_io(tmp_path):
    from rlhf_lightning.run import run

    cfg = compose_config(
        [*FAST, "trainer.max_steps=1", "eval.before_training=false", "eval.at_end=false"],
        output_dir=tmp_path / "run",
    )
    result = run(cfg)
    assert isinstance(result.trainer.strategy.checkpoint_io, AtomicCheckpointIO)
    ckpts = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("*.ckpt"))
    assert "last.ckpt" in ckpts and not [p for p in ckpts if p.startswith(".")]


@pytest.mark.slow
def test_a_second_ctrl_c_during_the_stop_checkpoint_exits_130(tmp_path, monkeypatch):
    """The second Ctrl-C lands while the first one's checkpoint is being written: torch's zip
    writer then raises its own error over the KeyboardInterrupt. The run still exits 130, the
    interrupted save leaves no file, and the checkpoint saved before it loads."""
    import io

    from rlhf_lightning.callbacks.signals import StopOnSignal
    from rlhf_lightning.run import run

    pressed: list[bool] = []
    real_batch_end, real_save = StopOnSignal.on_train_batch_end, torch.save

    def first_press_after_step_3(self, trainer, *args):
        if trainer.global_step == 3 and not pressed:
            pressed.append(True)
            os.kill(os.getpid(), signal.SIGINT)  # handled at once: stop after this step
        return real_batch_end(self, trainer, *args)

    class SecondPressMidWrite(io.RawIOBase):
        def __init__(self, f):
            self.f, self.writes = f, 0

        def writable(self):
            return True

        def write(self, b):
            self.writes += 1
            if self.writes == 3:
                os.kill(os.getpid(), signal.SIGINT)
            return self.f.write(b)

    def save(obj, f, *args, **kwargs):
        return real_save(obj, SecondPressMidWrite(f) if pressed else f, *args, **kwargs)

    monkeypatch.setattr(StopOnSignal, "on_train_batch_end", first_press_after_step_3)
    monkeypatch.setattr(torch, "save", save)
    cfg = compose_config(
        [*FAST, "trainer.max_steps=6", "checkpoint.every_n_steps=2", "eval.before_training=false"],
        output_dir=tmp_path / "run",
    )
    with pytest.raises(SystemExit) as stopped:
        run(cfg)
    assert stopped.value.code == 128 + signal.SIGINT
    ckpts = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert "last.ckpt" in ckpts and not [n for n in ckpts if n.startswith(".")], ckpts  # no temp file
    assert torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 2


@pytest.mark.slow
def test_a_second_ctrl_c_after_the_fit_exits_130(tmp_path, monkeypatch):
    """The second Ctrl-C lands once the fit has stopped, in the final adapter export, where
    Python's own handler is back: still 130, and the stop's checkpoint is there."""
    from rlhf_lightning.callbacks.adapters import AdapterExport
    from rlhf_lightning.callbacks.signals import StopOnSignal
    from rlhf_lightning.run import run

    real_batch_end = StopOnSignal.on_train_batch_end

    def first_press_after_step_2(self, trainer, *args):
        if trainer.global_step == 2 and not self.received:
            os.kill(os.getpid(), signal.SIGINT)
        return real_batch_end(self, trainer, *args)

    def second_press(self, trainer, pl_module):
        os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(StopOnSignal, "on_train_batch_end", first_press_after_step_2)
    monkeypatch.setattr(AdapterExport, "export_final", second_press)
    cfg = compose_config(
        [*FAST, "trainer.max_steps=6", "eval.before_training=false"], output_dir=tmp_path / "run"
    )
    # the process starts with Python's own handler, as train.py does (an xdist worker, or an
    # earlier test in it, may have left another one installed)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(SystemExit) as stopped:
            run(cfg)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert stopped.value.code == 128 + signal.SIGINT
    assert torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 2


def test_a_refused_run_leaves_the_live_runs_hydra_files(tmp_path):
    """A second run naming a live run's output_dir is refused before it writes anything there:
    Hydra's .hydra/ copy is off, and the run writes its own once it owns the directory."""
    run = tmp_path / "live"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        hold(run, sleeper.pid)  # a live process holds the directory
        (run / ".hydra").mkdir()
        (run / ".hydra" / "config.yaml").write_text("seed: 0\n")
        (run / ".hydra" / "overrides.yaml").write_text("- seed=0\n")
        out = train(tmp_path, "seed=1", f"output_dir={run}", rc=1)
        assert f"invalid config: output_dir='{run}'" in out and "a directory no live run uses" in out
        assert (run / ".hydra" / "config.yaml").read_text() == "seed: 0\n"
        assert (run / ".hydra" / "overrides.yaml").read_text() == "- seed=0\n"
        # nothing else: Hydra's job log handler opens <dir>/train.log (append) but the refused run
        # logs nothing into it
        assert sorted(p.name for p in run.iterdir() if p.name != "train.log") == [".hydra", ".run.lock"]
        assert not (run / "train.log").exists() or (run / "train.log").read_text() == ""
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.slow
def test_a_run_writes_its_hydra_files_and_progress_lines_without_a_terminal(tmp_path):
    run = tmp_path / "run"
    out = train(
        tmp_path,
        "trainer.max_steps=4",
        "trainer.val_check_interval=2",
        "progress.every_n_steps=2",
        "checkpoint.every_n_steps=2",
        f"output_dir={run}",
    )
    # stdout is a pipe here, as in a log file, CI or SLURM
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert [line.split(" |")[0] for line in lines] == ["step 2/4 (50%)", "step 4/4 (100%)"], out[-3000:]
    assert "reward " in lines[0] and "eval acc " in lines[0] and "(step 0)" in lines[0]
    assert "elapsed" in lines[1] and "ETA" in lines[0] and "ETA" not in lines[1]
    assert "(step 2)" in lines[1]
    assert "weights_only" not in out and "adapter exported" not in out
    hydra = run / ".hydra"
    assert (hydra / "config.yaml").read_text() == (run / "config.yaml").read_text()
    assert "trainer.max_steps=4" in (hydra / "overrides.yaml").read_text()
    assert (hydra / "hydra.yaml").is_file()
    assert list(run.glob("*.log"))  # Hydra's job log is still there


def test_progress_line_format():
    lines: list[str] = []

    class Sink:
        def write(self, text: str) -> None:
            lines.append(text)

        def flush(self) -> None:
            pass

    log = ProgressLog(10, stream=Sink())
    log.started = time.perf_counter() - 30
    line = log.line(300, 900, {"rollout/reward_mean": torch.tensor(0.41234)})
    assert line.startswith("step 300/900 (33%) | reward 0.412 | 30s elapsed | ETA 1m 00s"), line
    assert format_duration(7530) == "2h 05m" and format_duration(59.4) == "59s"
    assert auto_every(900) == 45 and auto_every(10) == 1 and auto_every(100000) == 100
    with pytest.raises(ValueError, match=r"progress\.every_n_steps"):
        ProgressLog(0)


def test_a_negative_seed_is_named(tmp_path):
    for seed in (-1, 2**32):
        with pytest.raises(ConfigError, match=rf"seed={seed}: an integer in \[0, 2\*\*32 - 1\]"):
            validate(compose_config([f"seed={seed}"], output_dir=tmp_path))


def test_optuna_with_zero_trials_names_the_field(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "-m", "hparams_search=optuna", "hydra.sweeper.n_trials=0"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode != 0
    assert "invalid config: hydra.sweeper.n_trials=0: a positive number of trials" in proc.stderr
    assert not list(tmp_path.glob("outputs/*/multirun/*/0"))  # no trial ran


def wait_for_step(run: Path, proc: subprocess.Popen, step: int) -> None:
    end = time.time() + 300
    while not ((run / "metrics.csv").exists() and any(r.split()[0] == str(step) for r in rows(run))):
        assert proc.poll() is None, proc.stdout.read()[-3000:]  # type: ignore[union-attr]
        assert time.time() < end
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_exits_130_and_leaves_one_last_checkpoint(tmp_path, presses):
    """One Ctrl-C: the step finishes, last.ckpt is saved (no last-v1.ckpt beside it, which
    keep_last would never delete). Two: the run stops at once. Both exit with 128 + SIGINT."""
    run = tmp_path / "run"
    proc = start(tmp_path, "checkpoint.every_n_steps=2", "logger.flush_every_n_steps=1", f"output_dir={run}")
    wait_for_step(run, proc, 3)
    proc.send_signal(signal.SIGINT)
    if presses == 2:
        time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGINT, out[-3000:]
    names = sorted(p.name for p in (run / "checkpoints").glob("*.ckpt"))
    assert not [n for n in names if n.startswith("last-v")], names
    if presses == 1:
        assert "last.ckpt" in names and "stopped by SIGINT after step" in out
