"""A command whose whole process tree ends with the process that started it.

``python -m rlhf_lightning.runtime.group_guard [--grace S] -- <command...>`` runs the command
(e.g. a vLLM server, whose engine and workers are processes of their own) and ends every
process of its group when

- the guard's parent is gone, ``kill -9`` included (checked every 0.2 s): SIGKILL to the group;
- the guard gets SIGTERM (a clean stop): SIGTERM to the command, then, after ``--grace``
  seconds or as soon as the command has exited, SIGKILL to what is left of the group;
- the command exits (a crashed or killed server): SIGKILL to what it left behind (a vLLM
  server's engine process outlives a killed API process), then the guard exits with the
  command's status (128 + N for a signal N) after a line on stderr saying how it ended.

The guard makes a process group of its own (``popen_guarded`` starts it in a session of its
own), so the group is the command's, and nothing else's. The guard itself has no parent-death signal (it must outlive
its parent long enough to end the group); the command gets one (SIGKILL when the guard dies).
:func:`popen_guarded` starts it that way; :func:`kill_group` ends a group from outside.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

POLL_S = 0.2
_PR_SET_PDEATHSIG = 1


def group_members(pgid: int) -> list[int]:
    """The pids whose process group is ``pgid`` (read from ``/proc``; empty off Linux)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)"
            if int(fields[2]) == pgid:
                out.append(int(stat.parent.name))
    return out


def kill_group(pgid: int) -> None:
    """SIGKILL every process of group ``pgid`` (nothing if it is gone)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _kill_others(pgid: int) -> None:
    """SIGKILL every process of group ``pgid`` but this one."""
    for pid in group_members(pgid):
        if pid != os.getpid():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def _parent_death_signal() -> None:
    """In the command's process, before exec: SIGKILL when the guard dies (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def exit_status(code: int) -> int:
    """A ``Popen.returncode`` as a shell would report it: 128 + N for signal N."""
    return 128 - code if code < 0 else code


def describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def guard(command: list[str], grace_s: float) -> int:
    """Run ``command`` and end its group as the module docstring says; returns the exit status."""
    if os.getpgrp() != os.getpid():
        os.setpgid(0, 0)  # a group of its own (never the starter's: it would end the starter)
    parent, pgid = os.getppid(), os.getpgrp()
    stop = {"at": None}  # when SIGTERM came (the grace period runs from there)

    def on_term(signum: int, frame: Any) -> None:
        if stop["at"] is None:
            stop["at"] = time.monotonic()  # type: ignore[assignment]
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signal.SIGTERM)

    child = subprocess.Popen(command, preexec_fn=_parent_death_signal)  # the guard has no threads
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the starter decides when a Ctrl-C ends the command
    while True:
        code = child.poll()
        if code is not None:
            print(f"group_guard: {' '.join(command[:3])} ... {describe(code)}", file=sys.stderr, flush=True)
            _kill_others(pgid)
            return exit_status(code)
        if os.getppid() != parent:  # the starter is gone (kill -9 included): end everything now
            kill_group(pgid)
        if stop["at"] is not None and time.monotonic() - stop["at"] > grace_s:
            _kill_others(pgid)
        time.sleep(POLL_S)


def popen_guarded(command: list[str], grace_s: float = 10.0, **kwargs: Any) -> subprocess.Popen[Any]:
    """Start ``command`` under a guard in a session of its own (``kwargs`` go to ``Popen``: the
    log file, the environment). The guard's pid is its process group's id."""
    from rlhf_lightning.runtime.children import popen

    argv = [
        sys.executable,
        "-m",
        "rlhf_lightning.runtime.group_guard",
        "--grace",
        str(grace_s),
        "--",
        *command,
    ]
    return popen(argv, start_new_session=True, **kwargs)


def main(argv: list[str]) -> int:
    grace_s = 10.0
    if argv[:1] == ["--grace"]:
        grace_s, argv = float(argv[1]), argv[2:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print(
            "usage: python -m rlhf_lightning.runtime.group_guard [--grace S] -- <command...>", file=sys.stderr
        )
        return 2
    return guard(argv, grace_s)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
