"""Every registered objective, estimator, aggregation and KL option trains; DAPO's dynamic
sampling keeps the batch full of informative groups; off-policy corrections are wired in."""

from __future__ import annotations

import pytest
import torch

from rlhf_lightning.losses import ADVANTAGE_ESTIMATORS, AGGREGATION_MODES, KL_ESTIMATORS, POLICY_LOSSES
from tests.conftest import FAST, compose_config, fit_steps

OUTCOME_ESTIMATORS = [n for n in ADVANTAGE_ESTIMATORS.names() if n != "gae"]  # gae needs a critic (algo=ppo)


def moved_parameters(cfg, tmp_path, steps=3):
    from rlhf_lightning.run import build

    module, _ = build(cfg, tmp_path)
    before = {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}
    module, trainer = fit_steps(cfg, tmp_path, steps=steps)
    after = dict(module.named_parameters())
    return [n for n in before if not torch.equal(before[n], after[n].detach())], trainer


CASES = (
    [("loss", name, []) for name in POLICY_LOSSES.names()]
    + [("advantage", name, []) for name in OUTCOME_ESTIMATORS]
    + [("loss_agg_mode", name, []) for name in AGGREGATION_MODES]
    + [("kl_estimator", name, ["algo.beta=0.1"]) for name in KL_ESTIMATORS]
    + [("kl_mode", name, ["algo.beta=0.1"]) for name in ("loss", "reward", "advantage")]
)


@pytest.mark.slow
@pytest.mark.parametrize(("field", "name", "extra"), CASES, ids=[f"{f}={n}" for f, n, _ in CASES])
def test_every_option_moves_the_parameters(fast_cfg, tmp_path, field, name, extra):
    # gspo's paper clip range (3e-4) would clip everything after the first of 2 epochs: use a wide one
    cfg = fast_cfg(f"algo.{field}={name}", "algo.lr=1e-2", "algo.clip_low=0.2", "algo.clip_high=0.2", *extra)
    moved, trainer = moved_parameters(cfg, tmp_path)
    assert moved, f"algo.{field}={name} left every trainable parameter unchanged"
    if "algo.beta=0.1" in extra:
        assert "actor/kl" in trainer.callback_metrics


class HalfConstantEnv:
    """Even rows: every completion gets reward 1 (a constant group). Odd rows: rewards alternate."""

    calls = 0

    def num_rows(self, evaluation: bool) -> int:
        return 200

    def reset(self, seed=None, *, row_index=None, evaluation=False):
        self.row = row_index
        return f"What is {row_index % 50} plus 1?", {}

    def step(self, action: str):
        HalfConstantEnv.calls += 1
        reward = 1.0 if self.row % 2 == 0 else float(HalfConstantEnv.calls % 2)
        return "", reward, True, False, {"even_row": self.row % 2 == 0}


@pytest.mark.slow
def test_dynamic_sampling_refills_the_batch_with_informative_groups(tmp_path):
    overrides = [o for o in FAST if not o.startswith("env.kwargs")]
    cfg = compose_config(
        [
            *overrides,
            "env=custom",
            "env._target_=tests.algorithms.test_objectives.HalfConstantEnv",
            "algo.dynamic_sampling=true",
            "algo.max_resample_rounds=8",
            "algo.prompts_per_step=4",
            "algo.group_size=4",
        ],
        output_dir=tmp_path / "run",
    )
    seen = []

    def hook(module):
        original = module.learner.update

        def spy(traj, scored, member):
            seen.append((traj.group_ids.clone(), scored.adv.clone()))
            return original(traj, scored, member)

        module.learner.update = spy

    _, trainer = fit_steps(cfg, tmp_path, steps=3, module_hook=hook)
    assert len(seen) == 3
    for group_ids, adv in seen:
        groups = group_ids.unique()
        assert len(groups) == 4  # the configured number of prompts per step
        for g in groups:
            assert adv[group_ids == g].abs().sum() > 0, "a group without learning signal was kept"
    metrics = trainer.callback_metrics
    assert metrics["rollout/informative_groups"].item() == 4
    assert metrics["rollout/dropped_groups"].item() >= 1
    assert metrics["env/even_row"].item() >= 0


@pytest.mark.slow
def test_truncated_is_metrics_and_rollout_old_logprobs(fast_cfg, tmp_path):
    _, trainer = fit_steps(fast_cfg("algo.tis_cap=2.0"), tmp_path, steps=1)
    # HF generate samples with the trainer's own weights: the gap is float noise.
    assert trainer.callback_metrics["is/gap_mean"].item() < 1e-4
    assert trainer.callback_metrics["is/clip_frac"].item() == 0
    _, trainer = fit_steps(
        fast_cfg("algo.old_logprobs_source=rollout", "algo.update_epochs=2", "algo.mini_batch_size=8"),
        tmp_path,
        steps=2,
    )
    assert "is/gap_mean" not in trainer.callback_metrics  # no trainer log-probs to compare


@pytest.mark.slow
def test_offpolicy_masks_and_overlong_penalty_are_logged(fast_cfg, tmp_path):
    cfg = fast_cfg(
        "algo.offpolicy_token_bounds=[0.5,2.0]",
        "algo.offpolicy_seq_threshold=1.0",
        "algo.overlong_buffer=4",
        "algo.mask_truncated=true",
        "rollout.max_new_tokens=6",
    )
    _, trainer = fit_steps(cfg, tmp_path, steps=1)
    m = trainer.callback_metrics
    assert m["is/masked_token_frac"].item() == 0  # the HF engine is the trainer
    assert m["is/masked_seq_frac"].item() == 0
    assert "rollout/overlong_penalty" in m and "rollout/masked_truncated_frac" in m


@pytest.mark.slow
def test_use_liger_loss_falls_back_on_cpu_with_one_warning(fast_cfg, tmp_path, caplog):
    with caplog.at_level("WARNING"):
        module, _ = fit_steps(fast_cfg("algo.use_liger_loss=true"), tmp_path, steps=2)
    from rlhf_lightning.learner.liger_path import LigerObjective

    assert not isinstance(module.learner.objective(module.schedule.members[0]), LigerObjective)
    messages = [r.getMessage() for r in caplog.records if "use_liger_loss" in r.getMessage()]
    assert len(messages) == 1 and "need a GPU" in messages[0]


def test_pass_at_k_estimator():
    from math import comb

    from rlhf_lightning.algorithms.evaluation import pass_at_k, pass_ks

    assert pass_ks(8) == [1, 2, 4, 8] and pass_ks(6) == [1, 2, 4, 6] and pass_ks(1) == [1]
    for n, c, k in [(8, 2, 1), (8, 2, 4), (8, 0, 3), (5, 5, 2), (10, 3, 8)]:
        expected = 1.0 - (comb(n - c, k) / comb(n, k) if n - c >= k else 0.0)
        assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)
