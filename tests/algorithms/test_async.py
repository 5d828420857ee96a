"""Asynchronous rollouts end to end (``rollout.mode=async``): lockstep equals synchronous, the
staleness bound holds on every trained token, the ratio's behaviour log-probs are the generating
policy's, partial rollouts change weights between turns, kill -9 + resume continues exactly,
and 2-process DDP runs."""

from __future__ import annotations

import csv
import json
import os
import signal
import time

import pytest
import torch

from rlhf_lightning.rollout.asynchronous.plan import batch_seed
from rlhf_lightning.run import checkpoint_step
from tests.conftest import FAST, compose_config, fit_steps
from tests.runtime.test_workers import children_of, cmdline
from tests.test_resume import (
    gone_within,
    killed_and_resumed,
    reference,
    rows,
    run_here,
    sigtermed_and_resumed,
    start,
    train,
    wait_for,
)

pytestmark = pytest.mark.slow

ASYNC = ["rollout.mode=async", "num_threads=1"]
PROBE = "+callbacks.probe._target_=tests.algorithms.async_probe.Probe"
# 8 x 8 episodes: every batch pickles to over 64 KiB, more than a pipe buffer (checked below)
BIG = [*ASYNC, "rollout.max_staleness=1", "algo.prompts_per_step=8", "algo.group_size=8", PROBE]


def record_rollouts(module, seen: list) -> None:
    """Append (step, rollout result) for every training rollout to ``seen``."""
    original = module.source.collect

    def spy(rows_, sampling, group_size):
        out = original(rows_, sampling, group_size)
        seen.append((module.source.batches_done, out[0]))
        return out

    module.source.collect = spy


def record_versions(module, versions: dict) -> None:
    """Keep a copy of every published version's weights in ``versions``."""
    producer = module.source.driver.transport
    original = producer.publish_weights

    def spy(version, weights):
        versions[version] = {k: v.clone() for k, v in weights.items()}
        original(version, weights)

    producer.publish_weights = spy


def record_updates(module, updates: list) -> None:
    """Append (step, trajectories, the ratio's old log-probs) for every update to ``updates``."""
    original = module.learner.update

    def spy(traj, scored, member):
        updates.append((module.source.batches_done, traj, scored.old_logp.detach().clone()))
        return original(traj, scored, member)

    module.learner.update = spy


@torch.no_grad()
def logps_under(module, weights: dict, traj) -> torch.Tensor:
    """The policy's log-probs of ``traj``'s tokens with ``weights`` put in (B, L-1)."""
    params = dict(module.policy.named_parameters())
    saved = {k: params[k].detach().clone() for k in weights}
    for k, v in weights.items():
        params[k].copy_(v)
    try:
        return module.policy.forward_heads(traj, ("logp",), temperature=module.sampling.temperature)["logp"]
    finally:
        for k, v in saved.items():
            params[k].copy_(v)


def test_lockstep_async_equals_sync_for_20_steps(tmp_path):
    """max_staleness=0 runs every batch through the producer, in lockstep: the metrics equal the
    synchronous run's, row by row, every column but timings and the async/* ones."""
    steps = ["trainer.max_steps=20", "checkpoint.every_n_steps=0"]
    run_here(*steps, f"output_dir={tmp_path / 'sync'}")
    run_here(*steps, *ASYNC, "rollout.max_staleness=0", f"output_dir={tmp_path / 'async'}")
    sync, lock = rows(tmp_path / "sync"), rows(tmp_path / "async")
    assert len(sync) > 20 and sync.keys() == lock.keys()
    for key in sync:
        got = {k: v for k, v in lock[key].items() if not k.startswith("async/")}
        assert got == sync[key], key
    with (tmp_path / "async" / "metrics.csv").open() as f:
        staleness = [r["async/staleness_max"] for r in csv.DictReader(f) if r.get("async/staleness_max")]
    assert len(staleness) == 20 and set(staleness) == {"0.0"}  # the producer made every batch


@pytest.mark.parametrize("k", [1, 2])
def test_no_trained_token_is_older_than_k_versions(tmp_path, k):
    """Every trained batch is labelled with version step - K, and the label is true: its sampling
    log-probs are the log-probs of that version's weights (not of the weights being trained)."""
    cfg = compose_config(
        [*FAST, *ASYNC, f"rollout.max_staleness={k}", "algo.lr=1e-2"], output_dir=tmp_path / "run"
    )
    module, seen, versions = fit_recorded(cfg, tmp_path, steps=5)
    assert [s for s, _ in seen] == [0, 1, 2, 3, 4]
    gaps = []
    for step, result in seen:
        labels = {v for t in result.trajectories for v in t.turn_versions}
        assert labels == {max(0, step - k)}, (step, labels)  # exactly as old as allowed
        batch, mask = result.batch, result.batch.action_mask
        named = logps_under(module, versions[max(0, step - k)], batch)
        assert (named[mask] - batch.sampling_logps[mask]).abs().max() < 1e-4, step
        if step >= k:  # stale: the weights trained at this step generate other log-probs
            current = logps_under(module, versions[step], batch)
            gaps.append(float((current[mask] - batch.sampling_logps[mask]).abs().max()))
    assert max(gaps) > 1e-3, gaps  # (a step whose groups all tie changes the weights little)
    assert {step - v for step, r in seen for t in r.trajectories for v in t.turn_versions} >= {k}


def test_the_ratio_uses_the_generating_policys_logprobs(tmp_path):
    """old_logprobs_source=rollout: the log-probs in the ratio are the engine's, which are the
    log-probs of the version that generated the batch (not of the weights being trained)."""
    cfg = compose_config(
        [*FAST, *ASYNC, "rollout.max_staleness=1", "algo.old_logprobs_source=rollout", "algo.lr=1e-2"],
        output_dir=tmp_path / "run",
    )
    updates: list = []
    versions: dict = {}

    def hook(module):
        record_versions(module, versions)
        record_updates(module, updates)

    module, _ = fit_steps(cfg, tmp_path, steps=4, module_hook=hook)
    assert [s for s, _, _ in updates] == [0, 1, 2, 3]
    for step, traj, old in updates[1:]:  # stale batches: generated with version step - 1
        mask = traj.action_mask
        torch.testing.assert_close(old[mask], traj.sampling_logps[mask])  # the engine's own
        behaviour = logps_under(module, versions[step - 1], traj)
        current = logps_under(module, versions[step], traj)
        assert (behaviour[mask] - old[mask]).abs().max() < 1e-4
        assert (current[mask] - old[mask]).abs().max() > 1e-3  # the trained weights differ


PARTIAL = [
    *FAST,
    *ASYNC,
    "rollout.max_staleness=1",
    "rollout.partial=true",
    "env=guess_number",
    "env.max_turns=3",
]


def test_planned_partial_rollouts_record_each_turns_version(tmp_path):
    """rollout.partial_versions=planned: turn 0 of batch s is generated with version s - 1 and
    turn 1 with version s; each token's behaviour log-prob is the one of its own turn's version."""
    cfg = compose_config([*PARTIAL, "rollout.partial_versions=planned"], output_dir=tmp_path / "run")
    assert_turns_carry_their_versions(*fit_recorded(cfg, tmp_path, steps=3))


def test_newest_partial_turns_use_published_weights_within_the_bound(tmp_path):
    """rollout.partial=true (newest, the default): every turn of batch s runs on a version between
    s - 1 and s, later turns never on older ones than earlier turns, and each token's behaviour
    log-prob is its own turn's version's."""
    cfg = compose_config(PARTIAL, output_dir=tmp_path / "run")
    module, seen, versions = fit_recorded(cfg, tmp_path, steps=4)
    multi = 0
    for step, result in seen[1:]:
        batch = result.batch
        under = {v: logps_under(module, versions[v], batch) for v in (step - 1, step)}
        for i, t in enumerate(result.trajectories):
            assert all(step - 1 <= v <= step for v in t.turn_versions) and t.turn_versions == sorted(
                t.turn_versions
            )
            tokens = torch.tensor(t.token_versions()[1:])
            for version, expected in under.items():
                cols = (tokens == version).nonzero().squeeze(-1)
                if len(cols):
                    assert (batch.sampling_logps[i, cols] - expected[i, cols]).abs().max() < 1e-4, (step, i)
            multi += t.num_turns >= 2
    assert multi > 0


def fit_recorded(cfg, tmp_path, steps: int) -> tuple:
    """Fit ``steps`` steps recording every rollout and every published version: (module, the
    (step, rollout) pairs, {version: weights})."""
    seen: list = []
    versions: dict = {}

    def hook(module):
        record_rollouts(module, seen)
        record_versions(module, versions)

    module, _ = fit_steps(cfg, tmp_path, steps=steps, module_hook=hook)
    return module, seen, versions


def assert_turns_carry_their_versions(module, seen: list, versions: dict) -> None:
    """K = 1, partial: each batch s after the first has turn 0 from version s - 1 and later turns
    from version s, and each generated token's log-prob is its own turn's version's."""
    two_turns = 0
    for step, result in seen[1:]:
        batch = result.batch
        before = logps_under(module, versions[step - 1], batch)
        after = logps_under(module, versions[step], batch)
        for i, t in enumerate(result.trajectories):
            assert t.turn_versions == [step - 1, step, step][: t.num_turns]
            tokens = torch.tensor(t.token_versions()[1:])  # aligned with the (L-1) action columns
            for version, expected in ((step - 1, before), (step, after)):
                cols = (tokens == version).nonzero().squeeze(-1)
                if len(cols):
                    got = batch.sampling_logps[i, cols]
                    assert (got - expected[i, cols]).abs().max() < 1e-4, (step, i, version)
            two_turns += t.num_turns >= 2
    assert two_turns > 0  # some episode ran on two versions


TIMINGS = ("async/trainer_wait_s", "async/producer_wait_s", "async/producer_work_s")


def assert_continues_exactly(reference, resumed, after: int) -> None:
    """Every metrics.csv row after step ``after`` equal, every column but timings (perf/*, the
    async waits)."""
    ref, got = rows(reference), rows(resumed)
    later = [k for k in ref if int(k.split()[0]) > after]
    assert later and [k for k in got if int(k.split()[0]) > after] == later
    for key in later:
        assert {k: v for k, v in got[key].items() if k not in TIMINGS} == {
            k: v for k, v in ref[key].items() if k not in TIMINGS
        }, key


def test_sigkill_of_the_trainer_alone_ends_its_producer_and_resume_continues_exactly(tmp_path):
    """Only the trainer's pid is killed (as the OOM killer does) while a batch of over 64 KiB
    (8 x 8 episodes) is in flight: its producer exits within seconds by itself (it used to block
    at exit on its queue's feeder thread), and the resume continues exactly."""
    uninterrupted, killed, step = killed_and_resumed(tmp_path, BIG[:-1], trainer_only=True)
    assert_continues_exactly(uninterrupted, killed, after=step)


def test_sigterm_saves_an_async_run_and_it_resumes_exactly(tmp_path):
    uninterrupted, run, step = sigtermed_and_resumed(tmp_path, [*ASYNC, "rollout.max_staleness=1"])
    assert_continues_exactly(uninterrupted, run, after=step)


def test_a_producer_killed_mid_run_ends_the_run_with_its_error_and_the_checkpoint_resumes(tmp_path):
    """SIGKILL of the producer while the trainer trains and a batch of over 64 KiB is in flight
    (the pipe buffer: a batch streamed through it left the trainer blocked in read() for ever):
    the trainer exits non-zero at once with the named error, far inside rollout.async_timeout_s,
    and resume=true from its last checkpoint continues exactly like an uninterrupted run."""
    overrides = [*BIG, "checkpoint.every_n_steps=1", "rollout.async_timeout_s=120"]
    uninterrupted = reference(tmp_path, overrides)
    run = tmp_path / "B"
    proc = start(tmp_path, *overrides, f"output_dir={run}")
    wait_for(run / "checkpoints" / "step_000003.ckpt", proc)
    (producer,) = [c for c in children_of(proc.pid) if "spawn_main" in cmdline(c)]
    os.kill(producer, signal.SIGKILL)
    killed_at = time.monotonic()
    out, _ = proc.communicate(timeout=300)
    waited = time.monotonic() - killed_at
    assert proc.returncode != 0 and waited < 30, (proc.returncode, waited)  # not the 120 s timeout
    assert f"the rollout producer (pid {producer}) was killed by SIGKILL while the trainer waited for" in out
    step = checkpoint_step(run / "checkpoints" / "last.ckpt")
    assert 3 <= step < 8
    assert not list((run / ".async").rglob("*.pkl"))  # the spool was emptied at the end
    run_here(*overrides, f"output_dir={run}", "resume=true")
    assert_continues_exactly(uninterrupted, run, after=step)
    batches = json.loads((run / "probe-rank0.json").read_text())["batches"]  # the resumed run's
    assert batches and min(b["bytes"] for b in batches) > 64 * 1024  # each larger than a pipe buffer


def test_two_processes_run_async(tmp_path):
    """2-process DDP: each rank's producer trains on its own rows with its own seeds, every rank
    publishes the same weights for every version, and staleness is bounded on both."""
    ddp = ["strategy=ddp", "trainer.accelerator=cpu", "trainer.devices=2"]
    train(
        tmp_path,
        *ddp,
        *ASYNC,
        PROBE,
        "trainer.max_steps=5",
        "checkpoint.every_n_steps=0",
        f"output_dir={tmp_path / 'D'}",
    )
    with (tmp_path / "D" / "metrics.csv").open() as f:
        trained = [r for r in csv.DictReader(f) if r.get("async/staleness_max")]
    assert [int(r["step"]) for r in trained] == [1, 2, 3, 4, 5]
    assert [float(r["async/staleness_max"]) for r in trained] == [0.0, 1.0, 1.0, 1.0, 1.0]
    ranks = [json.loads((tmp_path / "D" / f"probe-rank{r}.json").read_text()) for r in (0, 1)]
    for b0, b1 in zip(ranks[0]["batches"], ranks[1]["batches"], strict=True):
        assert b0["step"] == b1["step"]
        assert not set(b0["rows"]) & set(b1["rows"])  # each rank its own shard of the prompts
        assert b0["seed"] != b1["seed"] and b0["tokens"] != b1["tokens"]  # its own sampling
        assert b0["seed"] == batch_seed(0, 0, b0["step"]) and b1["seed"] == batch_seed(0, 1, b1["step"])
    assert len(ranks[0]["batches"]) == 5
    assert ranks[0]["versions"] == ranks[1]["versions"] and len(ranks[0]["versions"]) == 6  # versions 0..5


def test_a_producer_killed_on_one_rank_ends_every_rank_at_once(tmp_path):
    """2-process DDP: rank 1's producer killed mid-run ends rank 1 with the named error, and rank
    0 with it (its collective sees the peer gone) within seconds, not at a timeout; nothing of
    the run is left."""
    ddp = ["strategy=ddp", "trainer.accelerator=cpu", "trainer.devices=2"]
    run = tmp_path / "D"
    proc = start(
        tmp_path,
        *ddp,
        *ASYNC,
        "checkpoint.every_n_steps=1",
        "rollout.async_timeout_s=120",
        f"output_dir={run}",
    )
    wait_for(run / "checkpoints" / "step_000003.ckpt", proc)
    rank1 = [c for c in children_of(proc.pid) if "train.py" in cmdline(c)]
    producers = [c for r in (proc.pid, *rank1) for c in children_of(r) if "spawn_main" in cmdline(c)]
    assert len(rank1) == 1 and len(producers) == 2
    victim = next(c for c in children_of(rank1[0]) if "spawn_main" in cmdline(c))
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0 and time.monotonic() - killed_at < 60
    assert f"the rollout producer (pid {victim}) was killed by SIGKILL" in out
    gone_within((*rank1, *producers), 10)  # nothing of the run is left
