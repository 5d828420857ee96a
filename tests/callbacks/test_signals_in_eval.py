"""SIGTERM during an evaluation run on its own, before or after training, ends the run with 143
(docs/guides/reliability.md), not 0: the evaluation stops after its batch in progress, the run
prints its summary, and a run stopped after training keeps the checkpoint it saved."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests.cli_zygote import ZygotePopen
from tests.test_resume import command, env

pytestmark = pytest.mark.slow

ARGS = [
    "algo.prompts_per_step=2",
    "algo.group_size=2",
    "trainer.enable_progress_bar=false",
    "env.kwargs.eval_size=60",  # 60 one-prompt batches, each held 0.3 s by the probe
    "eval.batch_size=1",
    "checkpoint.every_n_steps=0",
    "num_threads=1",
    "+callbacks.probe._target_=tests.callbacks.eval_probe.SlowEval",
]


def sigterm_during_the_evaluation(
    tmp_path: Path, when: str, *overrides: str, sig: int = signal.SIGTERM
) -> tuple[int, str, Path]:
    """Start a run, send ``sig`` once its evaluation ``when`` (before/after) training has run a
    batch; the exit code, the output and the run directory."""
    marker, run = tmp_path / "evaluating", tmp_path / "run"
    proc = ZygotePopen(
        command(*ARGS, f"+callbacks.probe.marker={marker}", f"output_dir={run}", *overrides),
        cwd=tmp_path,
        env=env(),
    )
    end = time.time() + 300
    while not marker.exists():
        assert proc.poll() is None, f"the run ended before its evaluation: {proc.stdout.read()[-3000:]}"
        assert time.time() < end, "the evaluation never started"
        time.sleep(0.05)
    assert marker.read_text() == when
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode is not None
    return proc.returncode, out, run


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGUSR1])
def test_a_stop_signal_during_the_evaluation_before_training_exits_128_plus_it(tmp_path, sig):
    code, out, run = sigterm_during_the_evaluation(tmp_path, "before", "trainer.max_steps=2", sig=sig)
    assert code == 128 + sig, out[-4000:]  # 143 for SIGTERM, 130 for SIGINT
    assert f"stopped by {signal.Signals(sig).name} during the evaluation" in out
    assert f"run stopped (exit code {128 + sig})" in out  # the summary
    assert not (run / "checkpoints" / "last.ckpt").exists()  # nothing was trained


def test_sigterm_during_the_evaluation_after_training_exits_143_with_the_checkpoint(tmp_path):
    code, out, run = sigterm_during_the_evaluation(
        tmp_path, "after", "trainer.max_steps=1", "eval.before_training=false"
    )
    assert code == 128 + signal.SIGTERM, out[-4000:]
    assert "stopped by SIGTERM during the evaluation" in out
    assert "run stopped (exit code 143)" in out
    assert (run / "checkpoints" / "last.ckpt").exists()
