"""Runs that survive: SIGKILL and SIGTERM followed by a resume continue exactly like the run that
was never interrupted; run directories are never shared; ``resume=true`` finds this run."""

from __future__ import annotations

import csv
import os
import signal
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import pytest

from rlhf_lightning.run import checkpoint_step
from tests.cli_zygote import ZygotePopen
from tests.conftest import ROOT
from tests.population.test_side_by_side import MEMBERS
from tests.runtime.test_workers import alive, children_of

pytestmark = pytest.mark.slow

ARGS = [
    "algo.prompts_per_step=4",
    "algo.group_size=4",
    "trainer.max_steps=8",
    "trainer.val_check_interval=3",
    "trainer.enable_progress_bar=false",
    "env.kwargs.eval_size=20",
    "eval.batch_size=20",
    "checkpoint.every_n_steps=2",
    "num_threads=1",
]
ALGOS = {
    "grpo": [],
    "dapo": ["algo=dapo"],
    "ppo": ["algo=ppo"],
    # members side by side: each member's adapter, optimizer, schedule and the evolution's state
    "population_side_by_side": MEMBERS,
}


def command(*overrides: str) -> list[str]:
    return [sys.executable, str(ROOT / "train.py"), *ARGS, *overrides]


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def run_here(*overrides: str, rc: int = 0) -> None:
    """``train.py``'s run in this process (``run(cfg)``), for runs whose command line is not
    what a test is about: the same code, without a new interpreter's imports."""
    from rlhf_lightning.run import run
    from tests.conftest import compose_config

    result = run(compose_config([*ARGS, *overrides]))
    assert result.exit_code == rc


def multi_process(overrides: list[str]) -> bool:
    return any(o.startswith("trainer.devices=") and o != "trainer.devices=1" for o in overrides)


def run_somewhere(cwd: Path, *overrides: str) -> None:
    """:func:`run_here`, or with several processes the command line (Lightning's launcher
    starts the ranks from ``sys.argv``)."""
    if multi_process(list(overrides)):
        train(cwd, *overrides)
    else:
        run_here(*overrides)


# Uninterrupted runs by their overrides, shared by the tests that compare an interrupted run
# with one. Overrides that change no metric are left out: checkpointing, log flushing, the
# producer's time limit, the async tests' probe callback.
QUIET = ("checkpoint.", "logger.flush_every_n_steps", "rollout.async_timeout_s", "+callbacks.probe")
_REFERENCES: dict[tuple[str, ...], Path] = {}


def reference(cwd: Path, overrides: list[str]) -> Path:
    """The directory of the uninterrupted run of ``overrides``, run once per session."""
    key = tuple(o for o in overrides if not o.startswith(QUIET))
    if key not in _REFERENCES:
        out = cwd / "A"
        run_somewhere(cwd, *key, "checkpoint.every_n_steps=0", f"output_dir={out}")
        _REFERENCES[key] = out
    return _REFERENCES[key]


def train(cwd: Path, *overrides: str, rc: int = 0) -> str:
    """``train.py``'s command line in its own process (forked from the tests' zygote: without a
    new interpreter's imports); returns what it printed (stdout and stderr)."""
    proc = start(cwd, *overrides)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == rc, out[-4000:]
    return out


def start(cwd: Path, *overrides: str) -> ZygotePopen:
    """``train.py`` started in its own session (a kill of its group reaches every rank)."""
    return ZygotePopen(command(*overrides), cwd=cwd, env=env())


def wait_for(path: Path, proc: ZygotePopen, timeout: float = 300) -> None:
    end = time.time() + timeout
    while not path.exists():
        assert proc.poll() is None, f"the run ended before {path} appeared: {proc.stdout.read()[-3000:]}"
        assert time.time() < end, f"{path} never appeared"
        time.sleep(0.1)


def rows(run: Path) -> dict[str, dict[str, str]]:
    """metrics.csv rows keyed by step (training rows) and step + 'eval' (evaluation rows), timing
    columns left out (they differ between any two runs)."""
    out = {}
    with (run / "metrics.csv").open() as f:
        for r in csv.DictReader(f):
            key = r["step"] + (" eval" if r.get("eval/accuracy_greedy") else "")
            out[key] = {k: v for k, v in r.items() if not k.startswith("perf/")}
    return out


def assert_continues_exactly(reference: Path, resumed: Path, after: int) -> None:
    ref = {k: v for k, v in rows(reference).items() if int(k.split()[0]) > after}
    got = {k: v for k, v in rows(resumed).items() if int(k.split()[0]) > after}
    assert ref and got.keys() == ref.keys()
    for key in ref:
        assert got[key] == ref[key], key  # every column, as written: bitwise on CPU in float32


def gone_within(pids: Iterable[int], seconds: float) -> None:
    """Every process of ``pids`` exits within ``seconds`` (the run's own process has ended; what
    it started follows it)."""
    deadline = time.time() + seconds
    while left := [p for p in pids if alive(p)]:
        assert time.time() < deadline, f"processes {left} outlived the run by {seconds} s"
        time.sleep(0.05)


def kill_the_trainer_alone(proc: ZygotePopen) -> None:
    """SIGKILL the trainer's own pid, not its group (as the OOM killer does), and check that its
    children (the rollout producer, workers) follow it within a few seconds."""
    children = children_of(proc.pid)
    assert children, "the trainer has no child process to outlive it"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    gone_within(children, 5)


def killed_and_resumed(
    tmp_path: Path, overrides: list[str], trainer_only: bool = False
) -> tuple[Path, Path, int]:
    """Run A uninterrupted (:func:`reference`); run B killed (SIGKILL: every process of it, or
    ``trainer_only`` the trainer alone, whose children must then exit by themselves) once its
    step-4 checkpoint exists, then resumed with ``resume=true``. Returns A's and B's
    directories and the step B's last checkpoint held (4, or 2 if killed before last.ckpt
    followed)."""
    reference_dir = reference(tmp_path, overrides)
    killed = tmp_path / "B"
    proc = start(tmp_path, *overrides, f"output_dir={killed}")
    wait_for(killed / "checkpoints" / "step_000004.ckpt", proc)
    if trainer_only:
        kill_the_trainer_alone(proc)
    else:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    step = checkpoint_step(killed / "checkpoints" / "last.ckpt")
    assert step >= 2
    run_somewhere(tmp_path, *overrides, f"output_dir={killed}", "resume=true")
    return reference_dir, killed, step


@pytest.mark.parametrize("algo", [*ALGOS, "grpo_2_processes"])
def test_sigkill_then_resume_continues_exactly(tmp_path, algo):
    # 2 processes: every rank's RNG states and data position are in the checkpoint
    ddp = ["strategy=ddp", "trainer.accelerator=cpu", "trainer.devices=2"]
    uninterrupted, killed, step = killed_and_resumed(tmp_path, ALGOS.get(algo, ddp))
    assert_continues_exactly(uninterrupted, killed, after=step)


def sigtermed_and_resumed(tmp_path: Path, overrides: list[str]) -> tuple[Path, Path, int]:
    """Run A uninterrupted (:func:`reference`); run B sent SIGTERM after its third step, which
    must save that step and exit 128 + 15, then resumed. Returns A's and B's directories and
    the step B saved."""
    overrides = ["checkpoint.every_n_steps=0", *overrides]
    reference_dir = reference(tmp_path, overrides)
    run = tmp_path / "B"
    proc = start(tmp_path, *overrides, "logger.flush_every_n_steps=1", f"output_dir={run}")
    metrics = run / "metrics.csv"
    end = time.time() + 300
    while not (metrics.exists() and any(r.startswith("3") for r in rows(run))):
        assert proc.poll() is None and time.time() < end
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    err, _ = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "stopped by SIGTERM after step" in err
    step = checkpoint_step(run / "checkpoints" / "last.ckpt")
    assert 3 <= step < 8  # the step the signal arrived in, not the end
    run_somewhere(tmp_path, *overrides, f"output_dir={run}", "resume=true")
    return reference_dir, run, step


def test_sigterm_saves_the_step_exits_nonzero_and_resumes_exactly(tmp_path):
    uninterrupted, run, step = sigtermed_and_resumed(tmp_path, [])
    assert_continues_exactly(uninterrupted, run, after=step)


def test_two_runs_started_together_get_two_directories(tmp_path):
    same = [
        "name=twin",
        "hydra.run.dir=outputs/twin/same",
        "trainer.max_steps=2",
        "checkpoint.every_n_steps=0",
    ]
    procs = [start(tmp_path, *same) for _ in range(2)]
    for p in procs:
        err, _ = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
    dirs = sorted(d.name for d in (tmp_path / "outputs" / "twin").iterdir() if (d / "metrics.csv").exists())
    assert dirs == ["same", "same_1"]
    for d in dirs:
        steps = [k for k in rows(tmp_path / "outputs" / "twin" / d) if " " not in k]
        assert steps == ["1", "2"]  # each step once: no interleaving


def test_resume_true_never_picks_a_sibling_run_with_another_config(tmp_path, monkeypatch):
    from rlhf_lightning.config.errors import ConfigError

    monkeypatch.chdir(tmp_path)  # the runs' outputs/ (train.py's default place) is this test's
    base = ["name=exp", "trainer.max_steps=2", "checkpoint.every_n_steps=2"]
    mine = tmp_path / "outputs" / "exp" / "mine"
    run_here(*base, f"output_dir={mine}")
    run_here(
        *base, "algo=cispo", f"output_dir={tmp_path / 'outputs' / 'exp' / 'sibling'}"
    )  # newer, other algo
    log = train(tmp_path, *base, "trainer.max_steps=3", "resume=true")  # the command line finds it
    assert f"resuming from {mine / 'checkpoints' / 'last.ckpt'}" in log
    assert [k for k in rows(mine) if " " not in k] == ["1", "2", "3"]
    with pytest.raises(ConfigError, match=r"invalid config: resume=True(?s:.*)algo\.lr"):
        run_here(*base, "algo.lr=0.5", "resume=true")
    with pytest.raises(ConfigError, match=r"differs in: algo\.lr: .* -> 0\.5(?s:.*)resume_force=true"):
        run_here(*base, "algo.lr=0.5", f"output_dir={mine}", "resume=true")


def test_checkpoints_and_adapters_are_bounded(tmp_path):
    run = tmp_path / "run"
    run_here(
        "trainer.max_steps=5",
        "checkpoint.every_n_steps=1",
        "checkpoint.keep_last=2",
        f"output_dir={run}",
    )
    ckpts = sorted(p.name for p in (run / "checkpoints").glob("*.ckpt"))
    assert ckpts == ["best.ckpt", "last.ckpt", "step_000004.ckpt", "step_000005.ckpt"]
    adapters = sorted(p.name for p in (run / "checkpoints" / "adapters").iterdir())
    assert adapters == ["best", "last", "step_000004", "step_000005"]  # best: best.ckpt's adapters


def test_a_collapsing_run_is_stopped_by_the_guard_within_20_steps(tmp_path):
    run = tmp_path / "run"
    out = train(
        tmp_path,
        "algo.lr=0.1",
        "trainer.max_steps=50",
        "algo.prompts_per_step=8",
        "checkpoint.every_n_steps=0",
        "guard.stop_on_collapse=true",
        f"output_dir={run}",
        rc=1,
    )
    assert "run stopped by the guard" in out and "collapse:" in out  # the CLI's exit code and words
    step = checkpoint_step(run / "checkpoints" / "last.ckpt")
    assert step <= 20
