"""Micro-batches by row count and by token budget (``algo.micro_batch_tokens``), by hand."""

from __future__ import annotations

import itertools

import pytest
import torch

from rlhf_lightning.learner.microbatch import split_by_tokens, split_rows


def as_lists(chunks: list[torch.Tensor]) -> list[list[int]]:
    return [c.tolist() for c in chunks]


def test_rows_in_fixed_chunks():
    assert as_lists(split_rows(torch.arange(5), 2)) == [[0, 1], [2, 3], [4]]
    assert split_rows(torch.arange(0), 2) == []


def test_rows_packed_while_rows_times_longest_fits_the_budget():
    lengths = [3, 5, 2, 8, 1, 1]
    # [0,1]: 2 x 5 = 10 fits; adding row 2 makes 3 x 5 = 15. [2] then [3]: 2 x 8 = 16 > 10.
    # [3] alone (8); [4,5]: 2 x 1.
    assert as_lists(split_by_tokens(torch.arange(6), lengths, 10)) == [[0, 1], [2], [3], [4, 5]]
    # the budget is the padded size: a short row after a long one costs the long one's length
    assert as_lists(split_by_tokens(torch.tensor([3, 4, 5]), lengths, 16)) == [[3, 4], [5]]


def test_indices_follow_the_given_order_and_lengths_are_per_row():
    lengths = [1, 9, 1, 1]
    order = torch.tensor([2, 0, 3, 1])  # a shuffled mini-batch: three short rows, then the long one
    assert as_lists(split_by_tokens(order, lengths, 9)) == [[2, 0, 3], [1]]


def test_a_row_longer_than_the_budget_runs_alone_and_nothing_is_lost():
    lengths = [12, 2, 2]
    chunks = split_by_tokens(torch.arange(3), lengths, 10)
    assert as_lists(chunks) == [[0], [1, 2]]
    assert torch.equal(torch.cat(chunks), torch.arange(3))
    assert split_by_tokens(torch.arange(0), lengths, 10) == []


def test_every_chunk_fits_or_is_a_single_row():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 40, (64,), generator=g).tolist()
    order = torch.randperm(64, generator=g)
    chunks = split_by_tokens(order, lengths, 48)
    assert torch.equal(torch.cat(chunks), order)
    for c in chunks:
        size = len(c) * max(lengths[i] for i in c.tolist())
        assert size <= 48 or len(c) == 1
    # greedy: no chunk could have taken the next chunk's first row
    for c, nxt in itertools.pairwise(chunks):
        rows = c.tolist() + nxt[:1].tolist()
        assert (len(rows)) * max(lengths[i] for i in rows) > 48


def fit_recording_chunks(tmp_path, overrides: list[str]):
    """One rollout step (2 epochs x 2 mini-batches: 4 optimizer steps) on the tiny model, with
    every update micro-batch's rows and padded size recorded."""
    from tests.conftest import FAST, compose_config, fit_steps

    cfg = compose_config(
        [*FAST, "algo.update_epochs=2", "algo.mini_batch_size=8", *overrides], output_dir=tmp_path / "run"
    )
    chunks: list[tuple[int, int]] = []

    def hook(module):
        original = module.learner.micro_step

        def spy(step, member, index, *args, **kwargs):
            width = int(step.traj.attention_mask[index].sum(-1).max())
            chunks.append((len(index), len(index) * width))
            return original(step, member, index, *args, **kwargs)

        module.learner.micro_step = spy

    module, _ = fit_steps(cfg, tmp_path, steps=4, module_hook=hook)
    params = {n: p.detach().clone() for n, p in module.policy.named_parameters() if p.requires_grad}
    return params, chunks


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [
        ["algo=grpo", "algo.skip_zero_advantage=false"],
        # the critic's LoRA B starts at 0: its first gradients (~1e-8) are where Adam turns the
        # summation order's float noise into a step of ~lr (as in test_distributed.py)
        ["algo=ppo", "algo.adam_eps=1e-6"],
    ],
    ids=["grpo", "ppo"],
)
def test_a_token_budget_gives_the_fixed_size_update(tmp_path, extra):
    # Adam's step is ~lr * g / |g|, blind to the gradient's scale, so float noise in the summation
    # order shows up as ~lr: a small lr keeps 4 optimizer steps comparable at 1e-6 (test_distributed).
    extra = [*extra, "algo.lr=1e-5"]
    fixed, fixed_chunks = fit_recording_chunks(tmp_path / "fixed", [*extra, "algo.micro_batch_size=2"])
    budget = 90
    packed, packed_chunks = fit_recording_chunks(
        tmp_path / "tokens", [*extra, f"algo.micro_batch_tokens={budget}"]
    )
    assert {n for n, _ in fixed_chunks} == {2}
    sizes = [n for n, _ in packed_chunks]
    assert len(set(sizes)) > 1 and sum(sizes) == sum(n for n, _ in fixed_chunks)  # rows packed unevenly
    assert all(tokens <= budget or n == 1 for n, tokens in packed_chunks)
    assert fixed.keys() == packed.keys() and fixed
    diff = max(float((packed[k] - fixed[k]).abs().max()) for k in fixed)
    assert diff <= 1e-6


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["algo.micro_batch_tokens=0"], "algo.micro_batch_tokens"),
        (["algo.micro_batch_tokens=512", "algo.micro_batch_size=4"], "algo.micro_batch_size"),
    ],
)
def test_bad_token_budgets_are_named(overrides, field):
    from rlhf_lightning.config.errors import ConfigError
    from rlhf_lightning.run.validation import validate
    from tests.conftest import compose_config

    with pytest.raises(ConfigError) as err:
        validate(compose_config(overrides))
    assert str(err.value).startswith(f"invalid config: {field}=")
