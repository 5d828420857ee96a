"""Worker processes for calls that may hang or run away: tool calls and env steps with a time
limit. A call past its limit is stopped for real: its worker is killed (SIGKILL) and a fresh one
started in its place, so nothing keeps running, holding the GIL or the CPU (a Python thread
cannot be stopped).

A :class:`WorkerPool` runs ``fn(*args, **kwargs)`` in one of ``size`` worker processes and
returns an :class:`Outcome` (the value, or the exception it raised, or :class:`CallTimeout`).
Each worker leads its own process group (session), and a stopped worker is killed with its whole
group: the processes a step or a tool started (a ``sleep``, a compiler) end with it.

``fn`` and its arguments travel pickled, so they must be picklable: module-level functions and
classes (pickled by name; the worker imports their module, with the parent's ``sys.path``).
The time limit counts from the moment the worker has the call unpacked (importing the
function's module the first time does not count), and a worker that dies during a call gives
:class:`WorkerDied` at once, never a hang (:mod:`rlhf_lightning.runtime.channel`). Workers die
with their parent (:func:`~rlhf_lightning.runtime.children.die_with_parent`); they sit outside the
terminal's process group and ignore SIGINT, so Ctrl-C reaches the parent only (which stops them).

A worker runs its calls in its main thread, so code that runs inside one (:func:`in_worker`)
can bound a nested call with a signal timer instead of another process (:func:`call_inline`).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlhf_lightning.runtime.channel import ChannelClosed, ChannelTimeout, Reader, Writer
from rlhf_lightning.runtime.children import (
    describe_exit,
    die_with_parent,
    kill_group_and_reap,
    parent_alive,
    popen,
    watch_parent,
)

START_TIMEOUT_S = 300.0  # a worker's start and its first import of a call's module
POLL_S = 0.5  # how often an idle worker looks whether its parent lives
_IN_WORKER = False


class CallTimeout(TimeoutError):
    """A call did not return within its time limit (its worker was killed)."""


class WorkerDied(RuntimeError):
    """The worker process ended during a call (killed, or crashed in native code)."""


class StartTimeout(RuntimeError):
    """A worker did not take up a call within :data:`START_TIMEOUT_S` (its start, the pickled
    call's transfer and the first import of the function's module): not the call's own limit."""


@dataclass
class Outcome:
    """What one call gave: its return value, or the exception it raised (or a timeout)."""

    output: Any = None
    error: BaseException | None = None

    @property
    def timed_out(self) -> bool:
        return isinstance(self.error, CallTimeout)


def in_worker() -> bool:
    """Whether this process is a worker of a :class:`WorkerPool`."""
    return _IN_WORKER


def _portable(err: BaseException) -> BaseException:
    """``err`` if it survives pickling, else a RuntimeError with its type, message and traceback."""
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:
        text = "".join(traceback.format_exception(type(err), err, err.__traceback__))
        return RuntimeError(f"{type(err).__name__}: {err}\n{text}")


class _Worker:
    """One worker process and its two one-way pipes (requests in, replies out)."""

    def __init__(self) -> None:
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        try:
            self.proc = popen(
                [sys.executable, "-m", "rlhf_lightning.runtime.workers", str(req_r), str(rep_w)],
                pass_fds=(req_r, rep_w),
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,  # its own process group: killed with whatever it starts
            )
        finally:
            os.close(req_r)  # the child's ends: with them closed here, a dead child is an EOF
            os.close(rep_w)
        self.requests, self.replies = Writer(req_w), Reader(rep_r)
        self.requests.send({"sys_path": list(sys.path), "cwd": os.getcwd(), "parent": os.getpid()})

    def call(self, payload: bytes, timeout_s: float | None) -> tuple[Outcome, bool]:
        """Run one pickled call; returns (its outcome, whether this worker can take another)."""
        start_s = START_TIMEOUT_S
        try:
            try:
                self.requests.send_bytes(payload, start_s)
                first = self.replies.recv(start_s)
            except ChannelTimeout:
                return Outcome(error=StartTimeout(_start_timeout_message(start_s))), False
            if first[0] == "started":
                try:
                    first = self.replies.recv(timeout_s)
                except ChannelTimeout:
                    return Outcome(error=CallTimeout(f"did not return within {timeout_s:g} s")), False
        except ChannelClosed:
            self.proc.wait()
            return Outcome(
                error=WorkerDied(f"the worker process {describe_exit(self.proc.returncode)}")
            ), False
        kind, value = first
        return (Outcome(output=value) if kind == "ok" else Outcome(error=value)), True

    def stop(self) -> None:
        """Kill the worker and every process it started (its process group), and reap it."""
        kill_group_and_reap(self.proc)
        self.requests.close()
        self.replies.close()


def _start_timeout_message(start_s: float) -> str:
    return (
        f"the worker process did not start the call within {start_s:g} s (its start and its first "
        "import of the function's module must fit in START_TIMEOUT_S); it was killed. A module "
        "that is slow to import (a large model loaded at import time) should load lazily"
    )


class WorkerPool:
    """Up to ``size`` worker processes, started when first needed; thread-safe (a call waits
    for a free worker)."""

    def __init__(self, size: int = 1) -> None:
        if size < 1:
            raise ValueError(f"a worker pool needs at least one worker, got {size}")
        self.size = size
        self._idle: list[_Worker] = []
        self._count = 0
        self._cond = threading.Condition()
        self._closed = False
        self.timeouts = 0  # calls stopped at their limit (each killed its worker)
        self.started = 0  # worker processes started

    def call(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> Outcome:
        """``fn(*args, **kwargs)`` in a worker: its value or its exception, or :class:`CallTimeout`
        after ``timeout_s`` (None: no limit), or :class:`WorkerDied`, or :class:`StartTimeout`
        when the worker did not take up the call (not counted in :attr:`timeouts`)."""
        try:
            payload = pickle.dumps((fn, args, kwargs or {}), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as err:
            raise TypeError(
                f"{getattr(fn, '__qualname__', fn)!r} cannot run in a worker process: it and its arguments "
                f"must be picklable (module-level functions and classes), but pickling failed: {err}"
            ) from err
        worker = self._acquire()
        keep = False
        try:
            outcome, keep = worker.call(payload, timeout_s)
            if outcome.timed_out:
                self.timeouts += 1
            return outcome
        finally:
            self._release(worker, keep)

    def _acquire(self) -> _Worker:
        with self._cond:
            while True:
                if self._closed:
                    raise RuntimeError("the worker pool is closed")
                if self._idle:
                    return self._idle.pop()
                if self._count < self.size:
                    self._count += 1
                    break
                self._cond.wait()
        try:
            return self._start()
        except BaseException:
            with self._cond:
                self._count -= 1
                self._cond.notify()
            raise

    def _start(self) -> _Worker:
        worker = _Worker()
        self.started += 1
        return worker

    def _release(self, worker: _Worker, keep: bool) -> None:
        with self._cond:
            keep = keep and not self._closed
            if keep:
                self._idle.append(worker)
            else:
                self._count -= 1
            self._cond.notify()
        if not keep:
            worker.stop()
            self._prestart()

    def _prestart(self) -> None:
        """Start a replacement for a killed worker now: it boots while the caller goes on."""
        with self._cond:
            if self._closed or self._count >= self.size:
                return
            self._count += 1
        try:
            worker = self._start()
        except BaseException:
            with self._cond:
                self._count -= 1
            raise
        with self._cond:
            self._idle.append(worker)
            self._cond.notify()

    def pids(self) -> list[int]:
        """The worker processes now idle (for tests and diagnostics)."""
        with self._cond:
            return [w.proc.pid for w in self._idle]

    def close(self) -> None:
        """Stop every worker (busy ones when their call returns); the pool takes no more calls."""
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._count -= len(idle)
            self._cond.notify_all()
        for worker in idle:
            worker.stop()


_SHARED: dict[str, WorkerPool] = {}
_SHARED_LOCK = threading.Lock()


def shared_pool(name: str, size: int) -> WorkerPool:
    """This process's pool called ``name`` (one for tools, one for env steps), with at least
    ``size`` workers; closed by :func:`close_shared_pools` (and at exit)."""
    with _SHARED_LOCK:
        pool = _SHARED.get(name)
        if pool is None or pool._closed:
            pool = _SHARED[name] = WorkerPool(size)
        pool.size = max(pool.size, size)
        return pool


def close_shared_pools() -> None:
    """Stop the workers of every shared pool (the next call starts new ones)."""
    with _SHARED_LOCK:
        pools = list(_SHARED.values())
        _SHARED.clear()
    for pool in pools:
        pool.close()


atexit.register(close_shared_pools)


def _forget_the_parents_pools() -> None:
    """In a forked child: the shared pools and their workers are the parent's (its next call
    starts its own), and closing them at the child's exit must not stop the parent's workers."""
    global _SHARED_LOCK
    _SHARED.clear()
    _SHARED_LOCK = threading.Lock()  # it may have been held by another thread at the fork


os.register_at_fork(after_in_child=_forget_the_parents_pools)


def call_inline(fn: Callable[[], Any], timeout_s: float | None) -> Outcome:
    """``fn()`` in this thread, stopped by a SIGALRM timer after ``timeout_s``: for the main
    thread of a worker process, where the caller's own process bounds everything else. Python
    code is interrupted at once; a call blocked inside native code when the timer fires is cut
    when it returns to Python (the worker's own deadline, if any, still holds)."""
    if timeout_s is None or threading.current_thread() is not threading.main_thread():
        try:
            return Outcome(output=fn())
        except Exception as err:
            return Outcome(error=err)

    def expire(signum: int, frame: Any) -> None:
        raise CallTimeout(f"did not return within {timeout_s:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        return Outcome(output=fn())
    except Exception as err:
        return Outcome(error=err)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# ---------------------------------------------------------------- the worker process
def _note_traceback(err: BaseException) -> None:
    """Add the call's traceback (the frames below :func:`_serve`) to ``err`` as a note: a pickled
    exception travels without its traceback, and the caller's shows only its own frames."""
    tb = err.__traceback__.tb_next if err.__traceback__ is not None else None
    if tb is not None:
        with contextlib.suppress(Exception):
            err.add_note("traceback in the worker process:\n" + "".join(traceback.format_tb(tb)).rstrip())


def _serve(requests: Reader, replies: Writer, parent: int) -> None:
    """Run calls until the parent closes the pipe (or dies)."""
    while True:
        try:
            data = requests.recv_bytes(POLL_S)
        except ChannelTimeout:
            if not parent_alive(parent):
                return
            continue
        except ChannelClosed:
            return
        try:
            fn, args, kwargs = pickle.loads(data)
        except BaseException as err:
            replies.send(("error", _portable(err)))
            continue
        replies.send(("started", None))
        try:
            reply: tuple[str, Any] = ("ok", fn(*args, **kwargs))
        except BaseException as err:
            _note_traceback(err)
            reply = ("error", _portable(err))
        try:
            data = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as err:
            problem = RuntimeError(f"the call returned, but its value cannot be pickled: {err}")
            data = pickle.dumps(("error", problem))
        replies.send_bytes(data)


def main(argv: list[str]) -> None:
    global _IN_WORKER
    requests, replies = Reader(int(argv[1])), Writer(int(argv[2]))
    setup = requests.recv(START_TIMEOUT_S)
    die_with_parent(setup["parent"])
    watch_parent(setup["parent"])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a SIGINT sent to it anyway: the parent decides
    sys.path[:] = setup["sys_path"]
    with contextlib.suppress(OSError):
        os.chdir(setup["cwd"])
    _IN_WORKER = True
    with contextlib.suppress(ChannelClosed):
        _serve(requests, replies, setup["parent"])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown: nothing of a finished call's module can hold it up


if __name__ == "__main__":  # python -m: run the imported module's main, so its globals are the ones used
    from rlhf_lightning.runtime import workers

    workers.main(sys.argv)
