"""Worker processes: values, exceptions and timeouts come back; a call past its limit is stopped
for real (the trainer's own Python work does not slow down, nothing is left running); a worker
that dies is reported at once; workers die with their parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from rlhf_lightning.runtime.workers import (
    CallTimeout,
    WorkerDied,
    WorkerPool,
    call_inline,
    close_shared_pools,
    in_worker,
)
from tests.cli_zygote import ZYGOTE_MARK
from tests.envs.slow_things import boom, sleepy, spin, suicide

ROOT = Path(__file__).resolve().parents[2]


def children_of_this_process() -> list[int]:
    """The pids of this process's live (non-zombie) children, from /proc, but multiprocessing's
    resource tracker (started once per process by the first spawned child, it lives as long as
    the process: an earlier test's) and the tests' command-line zygote (tests/cli_zygote.py)."""
    return [
        c
        for c in children_of(os.getpid())
        if not any(m in cmdline(c) for m in ("resource_tracker", ZYGOTE_MARK))
    ]


_BEFORE: set[int] = set()  # children an earlier test of this process left (note_children)


def note_children() -> None:
    """Remember the children alive now: what an earlier test of this xdist worker left is not what
    the test that calls this starts (the leftovers are shown in its log, not blamed on it)."""
    _BEFORE.clear()
    _BEFORE.update(children_of_this_process())
    if _BEFORE:
        print("children left by an earlier test:", "; ".join(f"{p}: {cmdline(p)[:200]}" for p in _BEFORE))


def new_children() -> list[int]:
    """This process's live children started since :func:`note_children`."""
    return [c for c in children_of_this_process() if c not in _BEFORE]


def assert_no_children() -> None:
    """No child started since :func:`note_children` is left (each named with its command line)."""
    left = new_children()
    assert not left, "children left: " + "; ".join(f"{pid}: {cmdline(pid)[:200]}" for pid in left)


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""


@pytest.fixture(autouse=True)
def no_shared_workers():
    """Each test starts without the shared pools' workers other tests may have left."""
    close_shared_pools()
    note_children()
    yield


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (exists and is not a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2 :].split()[0] != "Z"


def children_of(parent: int) -> list[int]:
    """The pids of ``parent``'s live (non-zombie) children, from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # state, ppid, ...
        if int(fields[1]) == parent and fields[0] != "Z":
            found.append(int(entry))
    return found


def is_worker() -> bool:
    return in_worker()


def test_values_exceptions_and_timeouts_come_back():
    pool = WorkerPool(2)
    try:
        assert pool.call(sleepy, (0.0,)).output == "awake"
        err = pool.call(boom, (7,)).error
        assert isinstance(err, RuntimeError) and str(err) == "boom 7"
        assert pool.call(is_worker).output is True and not in_worker()
        started = time.monotonic()
        out = pool.call(spin, (1,), timeout_s=0.2)
        assert isinstance(out.error, CallTimeout) and out.timed_out and time.monotonic() - started < 2.0
        died = pool.call(suicide, (3,)).error
        assert isinstance(died, WorkerDied) and "exited with code 3" in str(died)
        assert pool.call(sleepy, (0.0,), timeout_s=5.0).output == "awake"  # a fresh worker took over
        assert pool.timeouts == 1
    finally:
        pool.close()
    assert_no_children()


def test_something_that_cannot_be_pickled_is_refused_before_any_worker_starts():
    pool = WorkerPool(1)
    with pytest.raises(TypeError, match="must be picklable"):
        pool.call(lambda: 1)
    assert pool.started == 0
    pool.close()


def python_rate(seconds: float = 0.3) -> float:
    """Iterations per second of a plain Python loop in this process (the trainer's own work)."""
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(1000):
            n += 1
    return n / seconds


def rate_after(before: float, share: float = 0.7, samples: int = 10) -> float:
    """The best :func:`python_rate` of up to ``samples`` tries, stopping once one reaches
    ``share`` of ``before``: a thread left holding the GIL slows every try, while the other
    test worker's load (xdist on 2 cores) slows only some."""
    best = 0.0
    for _ in range(samples):
        best = max(best, python_rate())
        if best / before > share:
            break
    return best


def test_runaway_calls_are_stopped_and_leave_nothing_running():
    """20 calls of a tool that loops for ever, each stopped at 0.2 s: this process's Python work
    runs as fast afterwards as before (abandoned threads would hold the GIL), and no worker
    process or thread is left once the pool closes."""
    pool = WorkerPool(2)
    pool.call(sleepy, (0.0,))  # started and warm, as a pool is after its first call
    threads_before = set(threading.enumerate())
    before = max(python_rate() for _ in range(3))
    outcomes = [pool.call(spin, (i,), timeout_s=0.2) for i in range(20)]
    assert all(o.timed_out for o in outcomes) and pool.timeouts == 20
    pool.call(sleepy, (0.0,))  # the last replacement has booted (its start is no runaway work)
    after = rate_after(before)
    assert after / before > 0.7, (before, after)  # with 20 abandoned threads this was ~0.1
    assert {t.name for t in set(threading.enumerate()) - threads_before} <= {"child-starter"}
    pool.close()
    assert_no_children()


def test_many_threads_share_a_pool():
    pool = WorkerPool(3)
    results: list = [None] * 12

    def one(i: int) -> None:
        if i % 3:  # a call that returns; its limit far from what it needs, even on a loaded machine
            results[i] = pool.call(sleepy, (0.05,), timeout_s=30.0)
        else:
            results[i] = pool.call(spin, (i,), timeout_s=0.5)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.timed_out for r in results] == [i % 3 == 0 for i in range(12)]
    assert all(r.output == "awake" for i, r in enumerate(results) if i % 3)
    pool.close()
    assert_no_children()


def test_inline_calls_are_stopped_by_a_timer_in_the_main_thread():
    assert call_inline(lambda: 3, None).output == 3
    started = time.monotonic()
    assert call_inline(lambda: spin(1), 0.2).timed_out and time.monotonic() - started < 1.0
    assert isinstance(call_inline(lambda: 1 / 0, 1.0).error, ZeroDivisionError)
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)  # the timer is off again


def test_workers_die_with_their_parent(tmp_path):
    """A parent killed with SIGKILL mid-call takes its workers with it (PR_SET_PDEATHSIG)."""
    script = tmp_path / "parent.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys, threading
            sys.path.insert(0, {str(ROOT)!r})
            from rlhf_lightning.runtime.workers import WorkerPool
            from tests.envs.slow_things import sleepy, spin
            pool = WorkerPool(2)
            pool.call(sleepy, (0.0,))
            for _ in range(2):  # the second worker is started for a thread
                threading.Thread(target=pool.call, args=(spin, (1,)), daemon=True).start()
            import time; time.sleep(0.5)
            print("up", flush=True)
            time.sleep(600)
            """
        )
    )
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "up\n"  # type: ignore[union-attr]
    kids = children_of(proc.pid)
    assert len(kids) == 2  # both spinning, one started from the main thread and one for a thread
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 5
    while any(alive(k) for k in kids):
        assert time.monotonic() < deadline, "a worker outlived its parent"
        time.sleep(0.05)
