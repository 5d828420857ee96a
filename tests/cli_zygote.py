"""``train.py`` command lines without a new interpreter's imports, for tests that need a run in
its own process (to kill it, signal it, or read what it prints) but do not test the imports.

A zygote process per test process imports torch, Lightning, transformers, peft, Hydra and the
package once (about 9 s of CPU a fresh ``python train.py`` pays first), then forks one child per
command line: the child starts its own session (its own process group, as ``Popen(...,
start_new_session=True)``), takes the command's working directory, environment and output file,
and runs the script as ``__main__``, then ends as an interpreter does (threads joined, atexit
functions run). The zygote reaps its children and writes each exit status
(``Popen.returncode``'s convention: negative for a signal) to ``<output>.rc``. :class:`ZygotePopen`
is the part of ``subprocess.Popen`` the tests use.

The zygote runs no torch operation before it forks (a forked thread pool would be unusable), and
it exits when the test process closes its pipe (or dies). Lightning's DDP launcher still starts
rank 1 as a fresh ``python train.py`` (``sys.argv[0]`` is the script's absolute path).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from rlhf_lightning.runtime.channel import write_atomic

ZYGOTE_MARK = "cli_zygote"  # in the zygote's command line: the leftover-children checks skip it
PRELOAD = (
    "torch",
    "lightning",
    "transformers",
    "peft",
    "hydra",
    "omegaconf",
    "rlhf_lightning.run",
    "rlhf_lightning.run.factories",
)


# ---------------------------------------------------------------- the zygote process
def _child(req: dict[str, Any]) -> None:
    """In the forked child: become the command and run it; never returns."""
    code = 1
    try:
        os.setsid()
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        out = os.open(req["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        err = os.open(req["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600) if req["err"] else out
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        for fd in {out, err, null}:
            os.close(fd)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        sys.argv = list(req["argv"])
        # the interpreter's path: the script's folder, then PYTHONPATH's entries, then the rest
        extra = [e for e in req["env"].get("PYTHONPATH", "").split(os.pathsep) if e]
        script_dir = str(Path(req["argv"][0]).parent)
        rest = [e for e in sys.path[1:] if e not in extra and e != script_dir]
        sys.path[:] = [script_dir, *extra, *rest]
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        import runpy

        code = 0
        try:
            runpy.run_path(req["argv"][0], run_name="__main__")
        except SystemExit as stop:
            if stop.code is None:
                code = 0
            elif isinstance(stop.code, int):
                code = stop.code
            else:
                print(stop.code, file=sys.stderr)
                code = 1
        except KeyboardInterrupt:
            code = 130
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        _finalize()
    finally:
        os._exit(code)


def _finalize() -> None:
    """What the interpreter does at a normal exit before it stops: wait for the non-daemon
    threads, run the atexit functions (multiprocessing's ends its daemonic children, loggers
    flush), flush the streams."""
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()


def zygote_main() -> None:
    """Read one JSON request a line from stdin, fork it, answer its pid; reap children."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for name in PRELOAD:
        __import__(name)
    pending: dict[int, str] = {}  # child pid -> its rc file
    stdin = sys.stdin.buffer
    buf = b""
    print("ready", flush=True)
    while True:
        ready, _, _ = select.select([stdin], [], [], 0.05)
        if ready:
            chunk = os.read(stdin.fileno(), 65536)
            if not chunk:
                break  # the test process is gone or done
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                req = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _child(req)
                pending[pid] = req["out"] + ".rc"
                print(pid, flush=True)
        while pending:
            try:
                pid, raw = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid in pending:  # Popen.returncode's convention: negative for a signal
                rc = str(os.waitstatus_to_exitcode(raw)).encode()
                with contextlib.suppress(OSError):  # the test process has gone and removed the logs
                    write_atomic(Path(pending.pop(pid)), rc)


# ---------------------------------------------------------------- the test side
class _Zygote:
    def __init__(self) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.cli_zygote", ZYGOTE_MARK],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=Path(__file__).resolve().parents[1],
        )
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ready"
        self.lock = threading.Lock()
        self.logs = Path(tempfile.mkdtemp(prefix="cli-zygote-"))  # every run's output, removed at exit
        atexit.register(shutil.rmtree, self.logs, True)

    def fork(self, argv: list[str], cwd: Path, env: dict[str, str], out: Path, err: Path | None) -> int:
        req = {"argv": argv, "cwd": str(cwd), "env": env, "out": str(out), "err": str(err) if err else None}
        with self.lock:
            assert self.proc.stdin is not None and self.proc.stdout is not None
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            return int(self.proc.stdout.readline())


_ZYGOTE: _Zygote | None = None


def zygote() -> _Zygote:
    global _ZYGOTE
    if _ZYGOTE is None or _ZYGOTE.proc.poll() is not None:
        _ZYGOTE = _Zygote()
    return _ZYGOTE


class ZygotePopen:
    """``subprocess.Popen(argv, cwd=..., env=..., stdout=PIPE, stderr=STDOUT (or PIPE with
    ``merged=False``), text=True, start_new_session=True)`` for ``argv = [python, script, *args]``,
    forked from the zygote; the output goes to files in the zygote's temporary directory."""

    def __init__(self, argv: list[str], *, cwd: Path, env: dict[str, str], merged: bool = True) -> None:
        forker = zygote()
        logs = Path(tempfile.mkdtemp(dir=forker.logs))
        self.out = logs / "stdout"
        self.err = None if merged else logs / "stderr"
        self.rc_file = Path(f"{self.out}.rc")
        script = str(Path(argv[1]).resolve())
        self.pid = forker.fork([script, *argv[2:]], Path(cwd), env, self.out, self.err)
        self.returncode: int | None = None
        self.stdout = _Output(self.out)

    def poll(self) -> int | None:
        if self.returncode is None and self.rc_file.exists():
            self.returncode = int(self.rc_file.read_text())
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired(str(self.out), timeout or 0)
            time.sleep(0.05)
        assert self.returncode is not None
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str | None]:
        self.wait(timeout)
        return self.stdout.read(), None if self.err is None else _Output(self.err).read()

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Output:
    """``Popen.stdout`` as the tests read it: everything written to ``path`` so far."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def read(self) -> str:
        return self.path.read_text(errors="replace") if self.path.exists() else ""


def run_cli(
    argv: list[str], *, cwd: Path, env: dict[str, str], timeout: float = 600, merged: bool = False
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(argv, stdout=PIPE, stderr=STDOUT if merged else PIPE, text=True)`` through
    the zygote."""
    proc = ZygotePopen(argv, cwd=cwd, env=env, merged=merged)
    out, err = proc.communicate(timeout)
    assert proc.returncode is not None
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


if __name__ == "__main__":
    zygote_main()
