"""A worker's own children end with it, and a worker that does not take up a call in time is
reported as such (not as the call's timeout, and not as a TypeError when the call has no limit)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from rlhf_lightning.runtime import workers
from rlhf_lightning.runtime.workers import CallTimeout, StartTimeout, WorkerPool, close_shared_pools
from tests.runtime.spawners import quick, spawn_and_hang, spawn_and_return
from tests.runtime.test_workers import alive


@pytest.fixture(autouse=True)
def no_shared_workers():
    close_shared_pools()
    yield


def gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return not alive(pid)


def wait_for_file(path: Path, seconds: float) -> str:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if path.is_file() and path.read_text():
            return path.read_text()
        time.sleep(0.05)
    raise AssertionError(f"{path} was not written within {seconds} s")


def test_a_timed_out_calls_children_are_killed_with_its_worker(tmp_path):
    pool = WorkerPool(1)
    pid_file = tmp_path / "child.pid"
    try:
        assert pool.call(quick).output == "ok"  # the worker is up: the limit below is the call's
        outcome = pool.call(spawn_and_hang, (str(pid_file),), timeout_s=2.0)
        assert isinstance(outcome.error, CallTimeout)
        child = int(wait_for_file(pid_file, 5.0))
        assert gone_within(child, 5.0), f"the timed-out call's child `sleep 60` (pid {child}) still runs"
    finally:
        pool.close()


def test_processes_a_call_left_behind_end_when_the_pool_closes():
    pool = WorkerPool(1)
    try:
        child = pool.call(spawn_and_return).output
        assert alive(child)  # the call returned; its background process runs on
    finally:
        pool.close()
    assert gone_within(child, 5.0), f"the call's background `sleep 60` (pid {child}) outlived the pool"


@pytest.mark.parametrize("limit", [None, 30.0])
def test_a_worker_that_does_not_take_up_a_call_in_time_is_a_start_timeout(monkeypatch, limit):
    from tests.runtime import spawners

    pool = WorkerPool(1)
    try:
        assert pool.call(spawners.quick).output == "ok"  # started and warm
        monkeypatch.setattr(workers, "START_TIMEOUT_S", 1.0)
        # the worker's first import of tests.runtime.slow_import takes 4 s: longer than the start
        # limit, shorter than the call's own limit
        from tests.runtime.slow_import import answer

        outcome = pool.call(answer, timeout_s=limit)
        assert isinstance(outcome.error, StartTimeout), outcome.error
        assert not outcome.timed_out and pool.timeouts == 0
        assert "did not start the call within 1 s" in str(outcome.error)
        assert "START_TIMEOUT_S" in str(outcome.error)
    finally:
        pool.close()


def test_an_exception_from_a_worker_keeps_its_traceback_as_a_note():
    from tests.envs.slow_things import boom

    pool = WorkerPool(1)
    try:
        error = pool.call(boom, (3,)).error
    finally:
        pool.close()
    assert isinstance(error, RuntimeError) and str(error) == "boom 3"
    notes = "\n".join(getattr(error, "__notes__", []))
    assert notes.startswith("traceback in the worker process:")
    assert "slow_things.py" in notes and 'raise RuntimeError(f"boom {x}")' in notes


def test_a_forked_child_neither_uses_nor_stops_the_parents_shared_workers():
    import os

    from rlhf_lightning.runtime.workers import shared_pool

    parent_pool = shared_pool("fork-test", 1)
    assert parent_pool.call(quick).output == "ok"
    (worker,) = parent_pool.pids()
    pid = os.fork()
    if pid == 0:  # the child: its own pool, then what its exit would do (close the shared pools)
        ok = False
        try:
            own = shared_pool("fork-test", 1)
            ok = own is not parent_pool and own.call(quick).output == "ok" and worker not in own.pids()
            close_shared_pools()
        except BaseException:
            pass
        os._exit(0 if ok else 3)  # never back into pytest
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert alive(worker) and parent_pool.call(quick).output == "ok"  # the parent's worker serves on
