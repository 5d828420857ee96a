"""Child processes that never outlive their parent, and their clean ends.

Every process this package starts (the rollout producer, tool and env-step workers) calls
:func:`die_with_parent` first thing: Linux then sends it SIGKILL the moment its parent exits,
however the parent ends (``kill -9``, the OOM killer, a crash), so no orphan keeps a GPU, an
engine or a port; and :func:`watch_parent` starts a thread that ends it when the parent is gone
(for systems without that signal). Linux ties the signal to the *thread* that started the
child, so children are started by :func:`popen` from the main thread or one long-lived thread,
never from a worker thread that may end before them.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from typing import Any

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> bool:
    """Ask the kernel for SIGKILL when the parent exits (Linux ``PR_SET_PDEATHSIG``); exit at
    once if ``parent_pid`` is already gone (it may have died before the request). Returns
    whether the kernel took the request (False off Linux: poll :func:`parent_alive`)."""
    armed = False
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            armed = libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    if os.getppid() != parent_pid:
        os._exit(0)
    return armed


def parent_alive(parent_pid: int) -> bool:
    """Whether this process's parent is still ``parent_pid`` (an orphan is adopted by another)."""
    return os.getppid() == parent_pid


def watch_parent(parent_pid: int, every_s: float = 0.2) -> None:
    """A daemon thread that ends this process (``os._exit``) once ``parent_pid`` is gone, even
    while the main thread runs away in Python code."""

    def watch() -> None:
        while parent_alive(parent_pid):
            time.sleep(every_s)
        os._exit(0)

    threading.Thread(target=watch, name="watch-parent", daemon=True).start()


_requests: queue.SimpleQueue[tuple[tuple[Any, ...], dict[str, Any], Future[Any]]] = queue.SimpleQueue()
_starter: threading.Thread | None = None
_starter_lock = threading.Lock()


def _start_children() -> None:
    while True:
        args, kwargs, done = _requests.get()
        try:
            done.set_result(subprocess.Popen(*args, **kwargs))
        except BaseException as err:
            done.set_exception(err)


def popen(*args: Any, **kwargs: Any) -> subprocess.Popen[Any]:
    """``subprocess.Popen(*args, **kwargs)`` from a thread that lives as long as this process
    (the main thread, or the one this module starts), so the child's parent-death signal fires
    when the process ends, not when a short-lived calling thread does."""
    global _starter
    if threading.current_thread() is threading.main_thread():
        return subprocess.Popen(*args, **kwargs)
    with _starter_lock:
        if _starter is None:
            _starter = threading.Thread(target=_start_children, name="child-starter", daemon=True)
            _starter.start()
    done: Future[subprocess.Popen[Any]] = Future()
    _requests.put((args, kwargs, done))
    return done.result()


def describe_exit(code: int | None) -> str:
    """A child's exit code as words: ``exited with code 3``, ``was killed by SIGKILL``."""
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def kill_and_reap(proc: subprocess.Popen[Any] | Any, timeout_s: float = 5.0) -> None:
    """SIGKILL ``proc`` (a ``Popen`` or a ``multiprocessing.Process``) and wait for it, so no
    zombie stays; a process already gone is only reaped."""
    if isinstance(proc, subprocess.Popen):
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout_s)
        return
    if proc.is_alive():
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    proc.join(timeout_s)


def kill_group_and_reap(proc: subprocess.Popen[Any], timeout_s: float = 5.0) -> None:
    """SIGKILL the process group that ``proc`` leads (started with ``start_new_session=True``):
    ``proc`` and every process it started that stayed in its group, then reap ``proc``. The group
    is signalled even when ``proc`` has already exited (its children may live on: Linux reuses
    no pid while a group of that id has a member); a group that is gone is skipped."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    kill_and_reap(proc, timeout_s)
