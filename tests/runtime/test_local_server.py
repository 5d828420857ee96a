"""runtime/local_server.py: a server the run starts (free port, guarded process, log, health
wait, stop) and the messages that name it."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from rlhf_lightning.runtime.group_guard import group_members
from rlhf_lightning.runtime.local_server import (
    LocalServer,
    ServerStartError,
    free_port,
    next_log_path,
    resume_hint,
)
from tests.runtime.test_workers import alive


def test_log_names_are_taken_once(tmp_path: Path):
    first, second = (
        next_log_path(tmp_path / "servers", "openenv"),
        next_log_path(tmp_path / "servers", "openenv"),
    )
    assert (first.name, second.name) == ("openenv-0.log", "openenv-1.log")
    assert first.is_file() and second.is_file()


def test_a_server_that_exits_while_starting_is_named_with_its_log_tail(tmp_path: Path):
    code = "import sys; print('no such app: my_pkg', flush=True); sys.exit(3)"
    server = LocalServer("the test server", [sys.executable, "-c", code], free_port(), tmp_path / "s.log")
    with pytest.raises(ServerStartError) as err:
        server.wait_ready(time.monotonic() + 60, "my.start_timeout_s")
    text = str(err.value)
    assert text.startswith(f"the test server ({server.url}) exited with code 3 while starting; its log: ")
    assert "no such app: my_pkg" in text and str(tmp_path / "s.log") in text
    assert (tmp_path / "s.log").read_text().startswith(f"$ {sys.executable} -c ")


def test_a_server_that_never_answers_is_stopped_with_everything_it_started(tmp_path: Path):
    code = "import subprocess, time; subprocess.Popen(['sleep', '60']); time.sleep(60)"
    server = LocalServer("the test server", [sys.executable, "-c", code], free_port(), tmp_path / "s.log")
    start = time.monotonic()
    with pytest.raises(ServerStartError, match=r"did not answer /health in time \(my\.start_timeout_s\)"):
        server.wait_ready(time.monotonic() + 1.0, "my.start_timeout_s")
    assert time.monotonic() - start < 5
    end = time.monotonic() + 10
    while len(group_members(server.pid)) < 3 and time.monotonic() < end:  # guard, python, sleep
        time.sleep(0.05)
    group = group_members(server.pid)
    assert server.death() is None
    server.stop(grace_s=1.0)
    assert server.death() is not None
    end = time.monotonic() + 5
    while any(alive(p) for p in group) and time.monotonic() < end:
        time.sleep(0.05)
    assert not [p for p in group if alive(p)]


def test_the_resume_hint_names_the_last_checkpoint(tmp_path: Path):
    ckpts = tmp_path / "run" / "checkpoints"
    assert "no checkpoint to resume from yet" in resume_hint(ckpts)
    ckpts.mkdir(parents=True)
    (ckpts / "last.ckpt").write_bytes(b"")
    assert resume_hint(ckpts) == (
        f"Resume with resume=true output_dir={tmp_path / 'run'}: it continues from {ckpts / 'last.ckpt'}"
    )
