"""Asynchronous rollouts end to end (``rollout.mode=async``): lockstep equals synchronous, the
staleness bound holds on every trained token, the ratio's behaviour log-probs are the generating
policy's, partial rollouts change weights between turns, kill -9 + resume continues exactly,
and 2-process DDP runs."""

from __future__ import annotations

import csv

import pytest
import torch

from tests.conftest import FAST, compose_config, fit_steps
from tests.test_resume import killed_and_resumed, rows, sigtermed_and_resumed, train

pytestmark = pytest.mark.slow

ASYNC = ["rollout.mode=async", "num_threads=1"]


def record_rollouts(module, seen: list) -> None:
    """Append (step, rollout result) for every training rollout to ``seen``."""
    original = module.training_rollout

    def spy(rows_):
        out = original(rows_)
        seen.append((module.collector.batches_done, out[0]))
        return out

    module.training_rollout = spy


def record_versions(module, versions: dict) -> None:
    """Keep a copy of every published version's weights in ``versions``."""
    producer = module.collector.async_rollouts
    original = producer.publish

    def spy(version, weights):
        versions[version] = {k: v.clone() for k, v in weights.items()}
        original(version, weights)

    producer.publish = spy


def record_updates(module, updates: list) -> None:
    """Append (step, trajectories, the ratio's old log-probs) for every update to ``updates``."""
    original = module.update

    def spy(traj, scored, old_logp, ref_logp):
        updates.append((module.collector.batches_done, traj, old_logp.detach().clone()))
        return original(traj, scored, old_logp, ref_logp)

    module.update = spy


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
    train(tmp_path, *steps, f"output_dir={tmp_path / 'sync'}")
    train(tmp_path, *steps, *ASYNC, "rollout.max_staleness=0", f"output_dir={tmp_path / 'async'}")
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
    cfg = compose_config([*FAST, *ASYNC, f"rollout.max_staleness={k}"], output_dir=tmp_path / "run")
    seen: list = []
    fit_steps(cfg, tmp_path, steps=5, module_hook=lambda m: record_rollouts(m, seen))
    assert [s for s, _ in seen] == [0, 1, 2, 3, 4]
    for step, result in seen:
        versions = {v for t in result.trajectories for v in t.turn_versions}
        assert versions == {max(0, step - k)}, (step, versions)  # exactly as old as allowed
        assert all(step - v <= k for v in versions)
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


def test_partial_rollouts_record_each_turns_version(tmp_path):
    """rollout.partial=true: turn 0 of batch s is generated with version s - 1 and turn 1 with
    version s; each token's behaviour log-prob is the one of its own turn's version."""
    cfg = compose_config(
        [
            *FAST,
            *ASYNC,
            "rollout.max_staleness=1",
            "rollout.partial=true",
            "env=guess_number",
            "env.max_turns=3",
        ],
        output_dir=tmp_path / "run",
    )
    assert_turns_carry_their_versions(*fit_recorded(cfg, tmp_path, steps=3))


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


def test_sigkill_then_resume_continues_an_async_run_exactly(tmp_path):
    killed, step = killed_and_resumed(tmp_path, [*ASYNC, "rollout.max_staleness=1"])
    assert_continues_exactly(tmp_path / "A", killed, after=step)


def test_sigterm_saves_an_async_run_and_it_resumes_exactly(tmp_path):
    run, step = sigtermed_and_resumed(tmp_path, [*ASYNC, "rollout.max_staleness=1"])
    assert_continues_exactly(tmp_path / "A", run, after=step)


def test_two_processes_run_async(tmp_path):
    ddp = ["strategy=ddp", "trainer.accelerator=cpu", "trainer.devices=2"]
    train(
        tmp_path,
        *ddp,
        *ASYNC,
        "trainer.max_steps=5",
        "checkpoint.every_n_steps=0",
        f"output_dir={tmp_path / 'D'}",
    )
    with (tmp_path / "D" / "metrics.csv").open() as f:
        trained = [r for r in csv.DictReader(f) if r.get("async/staleness_max")]
    assert [int(r["step"]) for r in trained] == [1, 2, 3, 4, 5]
    assert [float(r["async/staleness_max"]) for r in trained] == [0.0, 1.0, 1.0, 1.0, 1.0]
