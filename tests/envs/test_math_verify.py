"""math-verify's checks are bounded wherever they run: an answer sympy would evaluate for hours
(``9^9^9^9``, a gold ``10^{10^{10}}-1``) counts as not correct within the limit, also on a
thread (env steps on threads, the async rollout thread), where math-verify's own timers are off."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time

import pytest

from rlhf_lightning.envs import math as math_env
from rlhf_lightning.envs.math import MathEnv, verify
from rlhf_lightning.runtime.workers import CallTimeout, Outcome, WorkerDied

pytest.importorskip("math_verify")


def on_a_thread(fn, *args, wait_s: float):
    """``fn(*args)`` on a daemon thread; its value, or a failure when it is still running after
    ``wait_s`` seconds (the thread is then left spinning: the bug this file guards against)."""
    box: dict[str, object] = {}
    thread = threading.Thread(target=lambda: box.update(value=fn(*args)), daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(wait_s)
    assert not thread.is_alive(), f"{fn.__name__}{args!r} still runs after {wait_s} s on a thread"
    return box["value"], time.monotonic() - started


RUNAWAY_ON_A_THREAD = """
import sys, threading, time
from rlhf_lightning.envs.math import verify
verify("\\\\boxed{1}", "1")  # the check's worker is up: what follows is the check alone
box = {}
started = time.monotonic()
thread = threading.Thread(target=lambda: box.update(value=verify(sys.argv[1], sys.argv[2], 1.0)))
thread.start()
thread.join()
print(box.get("value"), round(time.monotonic() - started, 2))
"""


@pytest.mark.parametrize(
    ("completion", "gold"),
    [
        ("The answer is 9^9^9^9", "3"),  # a runaway reply
        ("\\boxed{5}", "10^{10^{10}}-1"),  # a runaway gold answer
    ],
)
def test_a_runaway_answer_on_a_thread_counts_as_wrong_within_the_limit(completion, gold):
    """In a fresh process (a check that holds the GIL would stall this test process too)."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", RUNAWAY_ON_A_THREAD, completion, gold],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"verify({completion!r}, {gold!r}) on a thread still ran after 60 s")
    assert done.returncode == 0, done.stderr
    value, took = done.stdout.split()
    assert value == "False"
    assert float(took) < 3 * 1.0 + 1 + 5  # the deadline (3 * timeout_s + 1), with room for a loaded machine


def test_answers_still_verify_on_a_thread_and_stay_fast():
    assert on_a_thread(verify, "so x = \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", wait_s=60.0)[0] is True
    assert on_a_thread(verify, "\\boxed{3}", "\\frac{1}{2}", wait_s=60.0)[0] is False
    started = time.monotonic()
    results = [verify(f"\\boxed{{{i}}}", str(i)) for i in range(100)]
    assert all(results)
    assert time.monotonic() - started < 20.0  # a reused worker: no process start per check


def test_a_check_stopped_at_its_deadline_counts_as_wrong_and_is_logged(monkeypatch, caplog):
    """What sympy work math-verify's timers cannot interrupt gives: the worker's CallTimeout (or
    its death) becomes False and a warning naming the answer."""
    calls = []

    class StoppedPool:
        def __init__(self, error: BaseException) -> None:
            self.error = error

        def call(self, fn, args, timeout_s=None):
            calls.append(timeout_s)
            return Outcome(error=self.error)

    for error in (CallTimeout("did not return within 7 s"), WorkerDied("the worker process was killed")):
        monkeypatch.setattr(math_env, "shared_pool", lambda name, size, e=error: StoppedPool(e))
        with caplog.at_level(logging.WARNING, logger=math_env.__name__):
            assert verify("x = \\boxed{9^9^9^9}", "3", 2.0) is False
        assert "9^9^9^9" in caplog.text and "counted as not correct" in caplog.text
        caplog.clear()
    assert calls == [7.0, 7.0]  # 3 * timeout_s + 1

    monkeypatch.setattr(math_env, "shared_pool", lambda name, size: StoppedPool(OSError("disk")))
    with pytest.raises(OSError, match="disk"):  # a real error of the check is not hidden
        verify("\\boxed{1}", "1")


def test_math_env_takes_a_verify_limit():
    env = MathEnv(verify_timeout_s=2.5)
    env.reset(seed=0)
    assert env.verify_timeout_s == 2.5
    with pytest.raises(ValueError, match=r"env\.kwargs\.verify_timeout_s must be > 0 seconds, got 0"):
        MathEnv(verify_timeout_s=0)


WHAT_THE_WORKER_UNPICKLES = """
import pickle, sys
from rlhf_lightning.envs import math as math_env
from rlhf_lightning.runtime.workers import Outcome
sent = []

class Pool:
    def call(self, fn, args, timeout_s=None):
        sent.append(pickle.dumps((fn, args)))
        return Outcome(output=True)

math_env.shared_pool = lambda name, size: Pool()
assert math_env.verify("\\\\boxed{1}", "1") is True
assert "math_verify" not in sys.modules, "the parent process imported math-verify"
fn, args = pickle.loads(sent[0])  # what a worker does before it starts the call's clock
print("math_verify" in sys.modules, fn(*args))
"""


def test_a_worker_imports_math_verify_before_the_checks_deadline_starts():
    """The call's limit counts from the moment the worker has it unpickled: unpickling the check
    imports math-verify (seconds on a loaded machine), so a fresh worker's first check gets its
    whole deadline; the parent never imports it."""
    done = subprocess.run(
        [sys.executable, "-c", WHAT_THE_WORKER_UNPICKLES],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True"]


def test_inside_an_env_step_worker_the_checks_use_one_worker(monkeypatch):
    sizes = []

    class Pool:
        def call(self, fn, args, timeout_s=None):
            return Outcome(output=True)

    def pool(name, size):
        sizes.append(size)
        return Pool()

    monkeypatch.setattr(math_env, "shared_pool", pool)
    assert verify("\\boxed{1}", "1") is True  # the trainer's process (env steps on threads)
    monkeypatch.setattr(math_env, "in_worker", lambda: True)  # an env.step_workers=process worker
    assert verify("\\boxed{1}", "1") is True
    assert sizes == [2, 1]
