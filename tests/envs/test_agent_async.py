"""env=agent under the run's guarantees: asynchronous rollouts in lockstep equal the synchronous
run on every logged value, a stale batch's every call records the version that served it (within
the staleness bound), and kill -9 + resume continues exactly (the episodes in flight are re-run).

All rest on ``env.kwargs.batching=rounds``: the engine sees the same batches whatever the timing.
"""

from __future__ import annotations

import csv
import os
import signal
import sys
from pathlib import Path

import pytest

from rlhf_lightning.run import checkpoint_step, run
from tests.algorithms.test_async import fit_recorded, logps_under
from tests.cli_zygote import ZygotePopen
from tests.conftest import ROOT, compose_config
from tests.envs.test_agent_env import AGENT
from tests.test_resume import env, rows, wait_for

pytestmark = pytest.mark.slow

SMALL = [
    *AGENT,
    "algo.prompts_per_step=2",
    "algo.group_size=4",
    "env.concurrency=4",
    "rollout.max_new_tokens=48",
    "num_threads=1",
    "trainer.val_check_interval=1000",
    "algo.lr=5e-3",  # large enough that the weights (so later rollouts) move each step
]
ASYNC = ["rollout.mode=async", "rollout.async_timeout_s=300"]
TIMINGS = ("async/trainer_wait_s", "async/producer_wait_s", "async/producer_work_s")


def run_agent(out: Path, *overrides: str) -> dict[str, dict[str, str]]:
    result = run(compose_config([*SMALL, *overrides], output_dir=out))
    assert result.exit_code == 0
    return rows(out)


def without(row: dict[str, str], prefixes: tuple[str, ...]) -> dict[str, str]:
    """``row`` less the columns named, and less empty cells (a column another row of the file
    needed, e.g. a later turn's reward, is empty here)."""
    return {k: v for k, v in row.items() if v != "" and not k.startswith(prefixes)}


def test_lockstep_async_equals_sync_on_every_logged_value(tmp_path):
    steps = ["trainer.max_steps=4", "checkpoint.every_n_steps=0"]
    sync = run_agent(tmp_path / "sync", *steps)
    lock = run_agent(tmp_path / "async", *steps, *ASYNC, "rollout.max_staleness=0")
    train = [k for k in sync if not k.endswith("eval")]
    assert len(train) == 4 and sync.keys() == lock.keys()  # and the evaluations before and after
    rewards = {sync[k]["rollout/reward_mean"] for k in train}
    assert len(rewards) > 1  # the runs are not trivially equal: rewards move between steps
    for key in sync:
        assert without(lock[key], ("async/",)) == without(sync[key], ("async/",)), key
    assert {lock[k]["async/staleness_max"] for k in train} == {"0.0"}  # the producer made every batch


def test_a_stale_batch_records_the_version_that_served_each_call(tmp_path):
    """max_staleness=1: batch s is generated with version s-1 (s >= 1). Every call of it records
    that version (its trajectory's ``turn_versions``, one per call), and the label is true: the
    behaviour log-probs of its tokens are that version's weights' log-probs."""
    cfg = compose_config([*SMALL, *ASYNC, "rollout.max_staleness=1"], output_dir=tmp_path / "k1")
    module, seen, versions = fit_recorded(cfg, tmp_path, steps=4)
    assert [s for s, _ in seen] == [0, 1, 2, 3]
    for step, result in seen:
        calls = [t.turn_versions for t in result.trajectories]
        assert all(len(v) == t.num_turns >= 1 for v, t in zip(calls, result.trajectories))
        assert {x for v in calls for x in v} == {max(0, step - 1)}, (step, calls)
        batch, mask = result.batch, result.batch.action_mask
        named = logps_under(module, versions[max(0, step - 1)], batch)
        assert (named[mask] - batch.sampling_logps[mask]).abs().max() < 1e-4, step


def test_kill_9_then_resume_continues_exactly(tmp_path):
    """The run killed (SIGKILL, every process of it: trainer, agent workers) once its step-4
    checkpoint exists, then resumed: the rows after the checkpoint equal the uninterrupted run's."""
    steps = ["trainer.max_steps=6"]
    reference = tmp_path / "A"
    tasks = f"env.kwargs.data.path={ROOT / 'examples' / 'agent_calc' / 'tasks.jsonl'}"  # cwd is tmp_path
    run_agent(reference, tasks, *steps, "checkpoint.every_n_steps=0")
    killed = tmp_path / "B"
    cmd = [sys.executable, str(ROOT / "train.py"), *SMALL, tasks, *steps, "checkpoint.every_n_steps=2"]
    proc = ZygotePopen([*cmd, f"output_dir={killed}"], cwd=tmp_path, env=env())
    wait_for(killed / "checkpoints" / "step_000004.ckpt", proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    step = checkpoint_step(killed / "checkpoints" / "last.ckpt")
    assert step >= 2
    run_agent(killed, tasks, *steps, "checkpoint.every_n_steps=2", "resume=true")
    ref, got = rows(reference), rows(killed)
    later = [k for k in ref if int(k.split()[0]) > step]
    assert later and [k for k in got if int(k.split()[0]) > step] == later
    for key in later:
        assert without(got[key], TIMINGS) == without(ref[key], TIMINGS), key
    with (killed / "metrics.csv").open() as f:
        assert [r["step"] for r in csv.DictReader(f)][-1] == "6"
