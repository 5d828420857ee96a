"""On-policy distillation with the exact reverse KL (``algo.distill.estimator=full``): the
policy's ``teacher_kl`` head against both models' full logits (plain rows, shared prompts,
packed turns), the loss term by hand and the settings it refuses (its pure-distillation run:
tests/learner/test_distill.py)."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.envs.guess_number import GuessNumberEnv
from rlhf_lightning.learner.objective import MicroBatch, PolicyObjective, PolicyTerm, TeacherKLTerm
from rlhf_lightning.learner.records import Scored
from rlhf_lightning.losses import aggregate
from rlhf_lightning.models.build import load_model
from rlhf_lightning.models.policy import Policy
from rlhf_lightning.records.sampling import SamplingParams
from rlhf_lightning.records.trajectory import Trajectory, collate
from rlhf_lightning.rollout.episodes.chat import ChatFormatter
from rlhf_lightning.rollout.episodes.harness import RolloutHarness
from tests.conftest import FAST, compose_config
from tests.envs.test_multiturn import RandomEngine
from tests.learner.test_distill import perturbed_teacher


def dense_kl(student, teacher, ids, act, temperature):
    """KL(student || teacher) at each action position from both models' full logits, float64.
    Shapes: ids (1, L); act (1, L-1) -> (L-1,)"""
    attn = torch.ones_like(ids)
    with torch.no_grad():
        ls = (student(input_ids=ids, attention_mask=attn).logits[0, :-1].double() / temperature).log_softmax(
            -1
        )
        lt = (teacher(input_ids=ids, attention_mask=attn).logits[0, :-1].double() / temperature).log_softmax(
            -1
        )
    return (ls.exp() * (ls - lt)).sum(-1) * act[0]


@pytest.fixture(scope="module")
def models(tiny_path, tmp_path_factory):
    student = load_model(tiny_path)
    teacher = load_model(str(perturbed_teacher(tmp_path_factory.mktemp("t") / "teacher")))
    return student, teacher


def single_turn_batch(tokenizer):
    """Four rows, two prompts each answered twice (rows that share a prompt run it once)."""
    prompts = ["What is 12 plus 30?", "Ben has 40 coins and gives away 11. How many are left?"]
    answers = [" 42", " The answer is 42", " 29", " 29 coins"]
    trajs = []
    for i, (p, a) in enumerate(zip(prompts * 2, answers[::2] + answers[1::2], strict=True)):
        pid, aid = tokenizer(p).input_ids, tokenizer(a).input_ids + [tokenizer.eos_token_id]
        trajs.append(
            Trajectory(
                pid + aid,
                [-1] * len(pid) + [0] * len(aid),
                [0.0] * (len(pid) + len(aid)),
                [0.0],
                i % 2,
                len(pid),
            )
        )
    return trajs, collate(trajs, tokenizer.pad_token_id)


def packed_batch(tokenizer):
    harness = RolloutHarness(
        lambda: GuessNumberEnv(max_turns=3), tokenizer, ChatFormatter(tokenizer), max_turns=3, history="last"
    )
    result = harness.rollout(RandomEngine(tokenizer, seed=5, cut_prob=0), [1, 2], SamplingParams(6))
    assert result.batch.position_ids is not None  # each turn its own sequence, packed
    return result.trajectories, result.batch


@pytest.mark.parametrize("make", [single_turn_batch, packed_batch], ids=["shared_prompts", "packed_turns"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_teacher_kl_head_equals_the_full_logits_formula(models, tiny_tokenizer, make, temperature):
    student, teacher = models
    trajs, batch = make(tiny_tokenizer)
    out = Policy(student).forward_heads(
        batch, ("logp", "teacher_kl"), temperature=temperature, chunk_rows=7, teacher=Policy(teacher)
    )
    checked = 0
    for i, traj in enumerate(trajs):
        starts = [*traj.segment_starts, len(traj.token_ids)]
        for s, e in itertools.pairwise(starts):  # each sequence as the model sees it alone
            ids = torch.tensor([traj.token_ids[s:e]])
            act = torch.tensor([[k >= 0 for k in traj.action_turn[s + 1 : e]]])
            want = dense_kl(student, teacher, ids, act, temperature)
            torch.testing.assert_close(out["teacher_kl"][i, s : e - 1].double(), want, rtol=1e-4, atol=1e-5)
            checked += int(act.any())
    assert checked >= len(trajs)
    kl = out["teacher_kl"][batch.action_mask]
    assert (kl > 0).all() and kl.mean() > 0.5  # a real divergence, not zeros
    assert (out["teacher_kl"][~batch.action_mask] == 0).all()


def test_the_loss_adds_coef_times_the_aggregated_kl_and_its_gradient(models, tiny_tokenizer):
    student, teacher = (copy.deepcopy(m).double() for m in models)  # float64: tight tolerances
    trajs, batch = single_turn_batch(tiny_tokenizer)
    # one forward per row as the dense reference runs it (the shared-prompt path's own float64
    # gradients differ from the unshared ones at ~1e-6: tests/models cover that path)
    policy, t_policy = Policy(student, share_prompt=False), Policy(teacher)
    adv = torch.tensor([1.0, -1.0, 0.5, 0.0])
    mask = batch.action_mask
    scored = Scored(adv, mask, {})
    mb = MicroBatch.rows_of(batch, scored, torch.arange(4), None, None)
    norm = {"num_tokens": mask.sum().float(), "num_seqs": torch.tensor(4.0)}
    plain = PolicyObjective(PolicyTerm("ppo_clip", {}))
    full = PolicyObjective(PolicyTerm("ppo_clip", {}), teacher_kl=TeacherKLTerm(0.3, t_policy))
    params = [p for p in student.parameters() if p.requires_grad]

    base, _ = plain(policy, mb, norm, lambda loss: None)
    with_kl, m = full(policy, mb, norm, lambda loss: None)
    # the gradient with zero advantages: the policy term adds exactly nothing (its own float32
    # rounding would otherwise blur a difference of two gradients)
    zero = MicroBatch.rows_of(batch, Scored(torch.zeros(4), mask, {}), torch.arange(4), None, None)
    g_full = torch.autograd.grad(full(policy, zero, norm, lambda loss: None)[0], params)

    per_row = torch.zeros(mask.shape, dtype=torch.float64)
    for i, traj in enumerate(trajs):
        ids = torch.tensor([traj.token_ids])
        act = torch.tensor([[k >= 0 for k in traj.action_turn[1:]]])
        per_row[i, : act.shape[1]] = dense_kl(student, teacher, ids, act, 1.0)
    kl_loss = 0.3 * per_row.sum() / mask.sum()  # token_mean over the window's tokens
    assert float(with_kl.detach() - base.detach()) == pytest.approx(float(kl_loss), rel=1e-9)
    assert float(m["distill/reverse_kl"]) == pytest.approx(float(per_row.sum() / mask.sum()), rel=1e-9)
    # the KL's own gradient: student logits -> its loss, densely through autograd
    logits = student(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    with torch.no_grad():
        t_logits = teacher(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    ls, lt = logits.log_softmax(-1), t_logits.log_softmax(-1)
    dense = aggregate((ls.exp() * (ls - lt)).sum(-1), mask, "token_mean", num_tokens=norm["num_tokens"])
    g_kl = torch.autograd.grad(0.3 * dense, params)
    for a, c in zip(g_full, g_kl, strict=True):
        torch.testing.assert_close(a, c, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (
            ["algo.teacher.path=x", "algo.distill.estimator=exact"],
            r"algo\.distill\.estimator='exact'.*sampled, full",
        ),
        (
            ["algo.teacher.path=x", "algo.distill.estimator=full", "algo.use_liger_loss=true"],
            r"algo\.use_liger_loss.*algo\.distill\.estimator=full",
        ),
    ],
)
def test_an_unknown_estimator_and_liger_with_the_full_kl_are_refused(overrides, match):
    from rlhf_lightning.run.validation import validate

    with pytest.raises(ConfigError, match=match):
        validate(compose_config([*FAST, *overrides]))
