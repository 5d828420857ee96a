"""A server process the run starts on 127.0.0.1: the generic part of the project's one rule for
servers (vLLM servers, OpenEnv env servers).

- A free port of 127.0.0.1 (:func:`free_port`), the command's output in a log file of the run
  directory (its first line: the command line).
- Started under :mod:`~rlhf_lightning.runtime.group_guard` (:func:`popen_guarded`): the server
  and whatever it starts end with the trainer however it ends, ``kill -9`` included.
- :meth:`LocalServer.wait_ready` polls its health endpoint until it answers 200; a server that
  exits or does not answer in time raises :class:`ServerStartError` naming the server and the
  tail of its log.
- :meth:`LocalServer.death` says how it ended (``was killed by SIGKILL``) so that a caller whose
  request failed can end the run naming it, its log and what to resume from (:func:`resume_hint`).
- :meth:`LocalServer.stop`: SIGTERM (the guard stops the command cleanly), then SIGKILL to the
  whole group.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

from rlhf_lightning.runtime.children import kill_and_reap
from rlhf_lightning.runtime.group_guard import describe, kill_group, popen_guarded

HOST = "127.0.0.1"
POLL_S = 0.25  # how often wait_ready asks the health endpoint


class ServerStartError(RuntimeError):
    """A server did not come up (it exited, or did not answer within the start timeout)."""


def free_port(host: str = HOST) -> int:
    """A TCP port nothing listens on now (the server binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def next_log_path(log_dir: Path, stem: str) -> Path:
    """``<log_dir>/<stem>-<i>.log`` for the smallest ``i`` no file holds yet, created empty (an
    exclusive create: two processes of one run never share a log)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    for i in range(10_000):
        path = log_dir / f"{stem}-{i}.log"
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            continue
        os.close(fd)
        return path
    raise ServerStartError(f"no free log name {stem}-<i>.log in {log_dir}")


def resume_hint(checkpoint_dir: str | Path | None) -> str:
    """What a run stopped by a server's death can resume from: its ``last.ckpt`` (or newest step
    checkpoint), or that it has none yet."""
    if checkpoint_dir is not None:
        ckpts = Path(checkpoint_dir)
        last = ckpts / "last.ckpt"
        found = [last] if last.is_file() else sorted(ckpts.glob("*.ckpt"), key=lambda p: p.stat().st_mtime)
        if found:
            return f"Resume with resume=true output_dir={ckpts.parent}: it continues from {found[-1]}"
    return (
        "The run has no checkpoint to resume from yet (checkpoint.every_n_steps sets how often one "
        "is written): run it again"
    )


class Starting(Protocol):
    """What :func:`wait_ready` asks of a starting server."""

    def healthy(self) -> bool: ...

    def death(self) -> str | None: ...

    def where(self) -> str: ...

    def log_tail(self) -> str: ...


def wait_ready(server: Starting, deadline: float, name: str, late: str) -> None:
    """Wait until ``server`` answers its health endpoint; raise :class:`ServerStartError` naming
    it (``name``), how it ended or what it did not answer in time (``late``), where its log is and
    the log's last lines, if it exits first or ``deadline`` (``time.monotonic()``) passes."""
    while not server.healthy():
        gone = server.death()
        if gone is not None:
            raise ServerStartError(f"{name} {gone} while starting; {server.where()}:\n{server.log_tail()}")
        if time.monotonic() > deadline:
            raise ServerStartError(f"{name} did not answer {late}; {server.where()}:\n{server.log_tail()}")
        time.sleep(POLL_S)


class LocalServer:
    """One server the run started: its URL, its guard process and its log.

    Args:
        name: what error messages call it (``the OpenEnv server my_pkg.server.app:app``).
        command: the command line; it must listen on ``HOST:port``.
        port: the port the command listens on (:func:`free_port`).
        log_path: where its stdout and stderr go (appended to).
        env: its environment (default: the trainer's).
        health_path: the path that answers 200 once it serves.
        grace_s: how long the guard waits after SIGTERM before SIGKILL.
    """

    def __init__(
        self,
        name: str,
        command: Sequence[str],
        port: int,
        log_path: Path,
        env: Mapping[str, str] | None = None,
        health_path: str = "/health",
        grace_s: float = 10.0,
    ) -> None:
        self.name, self.command, self.port = name, list(command), port
        self.url = f"http://{HOST}:{port}"
        self.log_path, self.health_path = Path(log_path), health_path
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            log.write(f"$ {' '.join(self.command)}\n".encode())
            log.flush()
            self.guard = popen_guarded(
                self.command,
                grace_s=grace_s,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env=dict(env) if env is not None else None,
            )

    @property
    def pid(self) -> int:
        """The guard's pid, also the process group of the server and what it starts."""
        return int(self.guard.pid)

    def death(self) -> str | None:
        """How the server ended (``was killed by SIGKILL``), or None while it runs."""
        code = self.guard.poll()
        if code is None:
            return None
        if code > 128:  # the guard reports a command killed by signal N as 128 + N
            return describe(128 - code)
        return describe(code) if code >= 0 else f"{describe(code)} (its guard process, which ends it)"

    def where(self) -> str:
        """Where to look: the log (its last lines are in the error messages too)."""
        return f"its log: {self.log_path}"

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(f"    {line}" for line in text[-lines:])

    def healthy(self, timeout_s: float = 2.0) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}{self.health_path}", timeout=timeout_s) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def wait_ready(self, deadline: float, timeout_field: str) -> None:
        """:func:`wait_ready` for this server (``timeout_field``: the setting that gives it its time)."""
        wait_ready(
            self, deadline, f"{self.name} ({self.url})", f"{self.health_path} in time ({timeout_field})"
        )

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM (the guard stops the server cleanly), then SIGKILL to the whole group."""
        if self.guard.poll() is None:
            self.guard.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.guard.wait(grace_s)  # then the group is killed below
        kill_group(self.pid)
        kill_and_reap(self.guard, timeout_s=5.0)
