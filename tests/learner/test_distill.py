"""On-policy distillation: the per-token advantage by hand in float64, a teacher with another
tokenizer refused before any model loads, and a run whose student moves toward its teacher."""

from __future__ import annotations

import csv
import shutil

import pytest
import torch

from rlhf_lightning.config import ASSETS
from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.learner.scoring import distilled_advantages
from tests.conftest import FAST, compose_config


def test_the_advantage_is_the_task_advantage_less_coef_times_the_sampled_reverse_kl():
    student = torch.tensor([[-1.0, -0.5, -2.0, 0.0], [-0.1, -3.0, 0.0, 0.0]], dtype=torch.float64)
    teacher = torch.tensor([[-1.5, -0.2, -2.0, -9.0], [-0.3, -1.0, -7.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)  # token 0 of row 0: a tool's
    task = torch.tensor([0.5, -1.0], dtype=torch.float64)
    adv, m = distilled_advantages(task, student, teacher, mask, coef=2.0)
    # k = student - teacher on the student's tokens: row 0: -, -0.3, 0.0, -; row 1: 0.2, -2.0, -, -
    expected = [[0.0, 0.5 - 2 * -0.3, 0.5 - 0.0, 0.0], [-1.0 - 2 * 0.2, -1.0 - 2 * -2.0, 0.0, 0.0]]
    assert torch.allclose(adv, torch.tensor(expected, dtype=torch.float64), atol=1e-12, rtol=0)
    assert float(m["distill/reverse_kl"]) == pytest.approx((-0.3 + 0.0 + 0.2 - 2.0) / 4, abs=1e-12)
    assert float(m["distill/teacher_logp"]) == pytest.approx((-0.2 - 2.0 - 0.3 - 1.0) / 4, abs=1e-12)
    pure, _ = distilled_advantages(task, student, teacher, mask, coef=1.0, task_reward=False)
    assert torch.allclose(
        pure, torch.tensor([[0.0, 0.3, 0.0, 0.0], [-0.2, 2.0, 0.0, 0.0]], dtype=torch.float64)
    )
    per_token = task[:, None].expand(2, 4).clone()  # a family's per-token advantages are kept as they are
    again = distilled_advantages(per_token, student, teacher, mask, 2.0)[0]
    assert torch.allclose(again, torch.tensor(expected, dtype=torch.float64), atol=1e-12, rtol=0)


def test_a_teacher_with_another_tokenizer_is_refused_before_any_model_loads(tmp_path, monkeypatch):
    from rlhf_lightning.run import factories

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the teacher's tokenizer was checked")

    monkeypatch.setattr(factories, "model_from", no_model)
    monkeypatch.setattr("rlhf_lightning.learner.teacher.load_model", no_model)
    cfg = compose_config([*FAST, f"algo.teacher.path={ASSETS / 'tiny_tools'}"], output_dir=tmp_path)
    with pytest.raises(
        ConfigError, match=r"algo\.teacher\.path=.*the student's tokenizer: the vocabularies differ"
    ):
        factories.build(cfg, tmp_path)


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["algo=distill"], r"algo\.teacher\.path=None.*learns from the teacher alone"),
        (["algo.teacher.path=x", "algo.distill.coef=-1"], r"algo\.distill\.coef=-1"),
    ],
)
def test_distillation_without_a_teacher_or_with_a_negative_coef_is_refused(overrides, field):
    from rlhf_lightning.run.validation import validate

    with pytest.raises(ConfigError, match=field):
        validate(compose_config([*FAST, *overrides]))


def perturbed_teacher(where):
    """The embedded model with its weights moved: the same tokenizer, another distribution."""
    from transformers import AutoModelForCausalLM

    shutil.copytree(ASSETS / "tiny_arithmetic", where)
    model = AutoModelForCausalLM.from_pretrained(where)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.5 * p.abs().mean())
    model.save_pretrained(where)
    return where


@pytest.mark.slow
@pytest.mark.parametrize("estimator", ["sampled", "full"])
def test_pure_distillation_moves_the_student_toward_its_teacher(tmp_path, estimator):
    """Every task advantage is 0 (pure distillation). ``full``: only the KL term trains, so no
    row is skipped, and there is no sampled-token scoring pass."""
    from rlhf_lightning.run import run

    teacher = perturbed_teacher(tmp_path / "teacher")
    out = tmp_path / "run"
    cfg = compose_config(
        [
            *FAST,
            f"algo.teacher.path={teacher}",
            "algo.distill.task_reward=false",
            f"algo.distill.estimator={estimator}",
            "algo.lr=1e-3",
            "trainer.max_steps=12",
            "trainer.val_check_interval=100",
            "samples.every_n_steps=0",
            "num_threads=1",
        ],
        output_dir=out,
    )
    assert run(cfg).exit_code == 0
    with (out / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    kl = [float(r["distill/reverse_kl"]) for r in rows if r.get("distill/reverse_kl")]
    assert len(kl) == 12
    if estimator == "full":
        assert all(r.get("distill/teacher_logp", "") == "" for r in rows)
    first, last = sum(kl[:3]) / 3, sum(kl[-3:]) / 3
    assert first > 0.5 and last < 0.6 * first, kl  # the student's own tokens: the teacher agrees more


@pytest.mark.slow
def test_a_teacher_equal_to_the_student_sees_no_divergence(tmp_path):
    from tests.conftest import fit_steps

    cfg = compose_config(
        [*FAST, f"algo.teacher.path={ASSETS / 'tiny_arithmetic'}"], output_dir=tmp_path / "r"
    )
    seen = []

    def spy(module):
        original = module.learner.score

        def score(traj, member, stale=False):
            scored = original(traj, member, stale)
            seen.append(float(scored.metrics["distill/reverse_kl"]))
            return scored

        module.learner.score = score

    fit_steps(cfg, tmp_path, steps=1, module_hook=spy)
    assert len(seen) == 1 and abs(seen[0]) < 1e-4  # the engine's log-probs are the teacher's
