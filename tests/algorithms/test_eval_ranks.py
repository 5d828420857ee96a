"""Evaluation with several processes: every eval row counted exactly once, whatever the world
size; every rank runs the same batches and rollouts (the collectives under FSDP)."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from rlhf_lightning.algorithms.evaluation import RolloutEvaluation, add_total, global_means
from rlhf_lightning.data.prompts import PAD_ROW, PromptDataModule, RowDataset, rank_eval_rows
from rlhf_lightning.records.result import RolloutResult
from rlhf_lightning.records.sampling import SamplingParams
from rlhf_lightning.records.trajectory import Trajectory
from tests.conftest import FAST
from tests.torchrun_jobs import launch


def chunks(rows: list[int], size: int) -> list[list[int]]:
    return [rows[i : i + size] for i in range(0, len(rows), size)]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("num_rows", [0, 1, 2, 3, 5, 7, 8, 12, 20])
@pytest.mark.parametrize("batch_size", [1, 2, 3, 6, 20])
def test_eval_rows_split_once_over_ranks_in_equal_numbers_of_batches(world, num_rows, batch_size):
    ranks = [rank_eval_rows(num_rows, batch_size, r, world) for r in range(world)]
    real = sorted(r for rows in ranks for r in rows if r != PAD_ROW)
    assert real == list(range(num_rows))  # every row once, whatever divides
    batches = [chunks(rows, batch_size) for rows in ranks]
    assert len({len(b) for b in batches}) == 1  # the same number of batches (of rollouts) everywhere
    assert len(batches[0]) == math.ceil(math.ceil(num_rows / world) / batch_size)  # rank 0's rows
    for per_rank in batches:
        for b in per_rank:
            assert b == [PAD_ROW] or PAD_ROW not in b  # padding: a batch of its own, one slot
    if world == 1:
        assert ranks[0] == list(range(num_rows))  # one process: every row, in order


def test_uneven_split_pads_the_short_rank_with_a_batch_of_its_own():
    # 20 rows on 3 ranks in batches of 6: 7, 7 and 6 rows; rank 2 would run one batch fewer.
    assert rank_eval_rows(20, 6, 2, 3) == [2, 5, 8, 11, 14, 17, PAD_ROW]
    assert rank_eval_rows(20, 6, 0, 3) == [0, 3, 6, 9, 12, 15, 18]
    assert rank_eval_rows(20, 4, 2, 3) == [2, 5, 8, 11, 14, 17]  # [4, 2] against [4, 3]: no padding
    assert rank_eval_rows(2, 5, 3, 4) == [PAD_ROW]  # fewer rows than ranks
    with pytest.raises(ValueError, match="rank 3 is not a rank of 3 processes"):
        rank_eval_rows(20, 6, 3, 3)
    with pytest.raises(ValueError, match=r"eval\.batch_size=0"):
        rank_eval_rows(20, 0, 0, 3)


class _Trainer:
    def __init__(self, rank: int, world: int) -> None:
        self.global_rank, self.world_size = rank, world


def val_loader(rank: int, world: int, num_rows: int = 20, batch_size: int = 6) -> DataLoader:
    dm = PromptDataModule(100, num_rows, 4, batch_size)
    dm.trainer = _Trainer(rank, world)  # type: ignore[assignment]
    return dm.val_dataloader()


def test_val_loader_batches_each_ranks_rows_and_leaves_the_global_rng_alone():
    loaders = [val_loader(r, 3) for r in range(3)]
    state = torch.random.get_rng_state()
    batches = [[b.tolist() for b in loader] for loader in loaders]
    assert torch.equal(torch.random.get_rng_state(), state)  # its own generator
    assert batches == [
        [[0, 3, 6, 9, 12, 15], [18]],
        [[1, 4, 7, 10, 13, 16], [19]],
        [[2, 5, 8, 11, 14, 17], [PAD_ROW]],
    ]
    assert [len(loader) for loader in loaders] == [2, 2, 2]
    solo = [b.tolist() for b in val_loader(0, 1)]
    assert solo == chunks(list(range(20)), 6)  # one process: as the plain sequential loader


def test_lightning_keeps_the_eval_sampler_under_ddp():
    import lightning as L
    from lightning.pytorch.trainer.states import RunningStage

    trainer = L.Trainer(accelerator="cpu", devices=3, strategy="ddp", logger=False)
    connector = trainer._data_connector
    ours = val_loader(0, 3)
    plain = DataLoader(RowDataset(20), batch_size=6)
    assert connector._requires_distributed_sampler(plain)  # what Lightning would re-split and pad
    assert not connector._requires_distributed_sampler(ours)
    assert connector._prepare_dataloader(ours, shuffle=False, mode=RunningStage.VALIDATING) is ours


def test_global_means_are_sums_over_counts_not_means_of_rank_means():
    # Three ranks with 3, 2 and 1 episodes (accuracy) and 2, 1, 0 problems (pass@2).
    accuracy = [[1.0, 0.0, 0.0], [1.0, 1.0], [1.0]]
    pass2 = [[1.0, 0.0], [1.0], []]
    ranks = []
    for acc, p in zip(accuracy, pass2):
        totals: dict[str, torch.Tensor] = {}
        add_total(totals, "eval/accuracy_sampled", torch.tensor(acc))
        add_total(totals, "eval/pass@2", torch.tensor(p), counted=bool(p))
        ranks.append(totals)
    assert [sorted(t) for t in ranks] == [sorted(ranks[0])] * 3  # the same keys on every rank
    stacks = [torch.stack([t[k] for k in sorted(t)]) for t in ranks]
    calls = []

    def all_reduce(t: torch.Tensor) -> torch.Tensor:  # what every rank gets back
        calls.append(t.shape)
        return sum(stacks, torch.zeros_like(t))

    means = global_means(ranks[0], all_reduce)
    assert calls == [(2, 2)]  # one collective for every metric: [sum, count] each
    assert means["eval/accuracy_sampled"] == torch.tensor(4 / 6, dtype=torch.float32)
    assert means["eval/pass@2"] == torch.tensor(2 / 3, dtype=torch.float32)
    assert means["eval/accuracy_sampled"] != torch.tensor((1 / 3 + 1 + 1) / 3, dtype=torch.float32)
    assert global_means({}, all_reduce) == {} and len(calls) == 1  # nothing evaluated: no collective
    assert global_means({"x": torch.zeros(2, dtype=torch.float64)}, lambda t: t) == {}  # no values


class _Evaluation(RolloutEvaluation):
    """The validation loop on a fake rollout: episode i of row r succeeds when r + i is even."""

    def __init__(self) -> None:
        super().__init__(policy=None, hp=None)
        self.source = self  # its own fake rollout source (generate below)
        self.sampling = SamplingParams(4, temperature=1.0)
        self.eval_greedy = self.eval_sampled = True
        self.eval_num_samples = 2
        self.calls: list[tuple[list[int], float]] = []

    def generate(self, rows, params, *, group_size, evaluation=False):
        self.calls.append((list(rows), params.temperature))
        trajs = [
            Trajectory(
                [1], [-1], [0.0], [float((r + i) % 2 == 0)], 0, 1, infos=[{"correct": (r + i) % 2 == 0}]
            )
            for r in rows
            for i in range(group_size)
        ]
        batch = type("Batch", (), {"returns": torch.tensor([t.rewards[0] for t in trajs])})()
        return RolloutResult(batch, trajs, {})  # type: ignore[arg-type]


def test_a_padding_batch_runs_the_same_rollouts_and_counts_nothing():
    real, padding = _Evaluation(), _Evaluation()
    real.on_validation_epoch_start()
    padding.on_validation_epoch_start()
    real.validation_step(torch.tensor([2, 5]), 0)
    padding.validation_step(torch.tensor([PAD_ROW]), 0)
    assert [t for _, t in real.calls] == [t for _, t in padding.calls] == [0.0, 1.0]  # greedy, sampled
    assert [rows for rows, _ in padding.calls] == [[0], [0]]  # a stand-in row
    assert real._eval_totals is not None and padding._eval_totals is not None
    assert sorted(real._eval_totals) == sorted(padding._eval_totals)  # the same collective
    assert all(v.tolist() == [0.0, 0.0] for v in padding._eval_totals.values())
    # Rows 2 and 5: greedy (one episode each) 1 of 2; sampled (2 each) 2 of 4; pass@2 2 of 2.
    assert real._eval_totals["eval/accuracy_greedy"].tolist() == [1.0, 2.0]
    assert real._eval_totals["eval/accuracy_sampled"].tolist() == [2.0, 4.0]
    assert real._eval_totals["eval/pass@1"].tolist() == [1.0, 2.0]
    assert real._eval_totals["eval/pass@2"].tolist() == [2.0, 2.0]


EVAL_ROWS = 20
# 20 rows over 3 ranks: 7, 7, 6; in batches of 6 ranks 0 and 1 run [6, 1] rows, rank 2 [6, padding].
ONE_EVAL = [
    *FAST,
    f"env.kwargs.eval_size={EVAL_ROWS}",
    "eval.batch_size=6",
    "eval.at_end=false",
    "algo.prompts_per_step=6",
    "algo.group_size=2",
    "trainer.max_steps=1",
    "checkpoint.every_n_steps=0",
    "checkpoint.save_last=false",
    "checkpoint.export_adapters=false",
    "checkpoint.monitor=null",
    "samples.every_n_steps=0",
    "num_threads=1",
    "eval.num_samples=2",  # pass@1 and pass@2 too
]


EVALS = {  # name -> the processes it runs on
    "one": ["trainer.accelerator=cpu", "trainer.devices=1"],
    "three_ddp": ["strategy=ddp", "trainer.accelerator=cpu", "trainer.devices=3"],
    "three_fsdp": [
        "strategy=fsdp",
        "trainer.accelerator=cpu",
        "trainer.devices=3",
    ],  # every rollout a collective
}


@pytest.fixture(scope="session")  # once per test process, however xdist orders the module's tests
def evaluations(tmp_path_factory) -> dict[str, tuple[dict[str, float], list[dict]]]:
    """Every run of :data:`EVALS` through the eval worker, one launch per number of processes:
    the eval metrics in ``metrics.csv`` (step 0) and, per rank, its one validation (the eval
    metrics it holds, its batches)."""
    tmp = tmp_path_factory.mktemp("eval")
    jobs: dict[int, list[dict]] = {}
    for name, overrides in EVALS.items():
        (tmp / name).mkdir()
        spec = {"overrides": [*ONE_EVAL, *overrides], "out": str(tmp / name)}
        jobs.setdefault(int(overrides[-1].split("=")[1]), []).append({"kind": "eval_worker", "spec": spec})
    for nproc, batch in jobs.items():
        launch(batch, nproc, tmp)
    out = {}
    for name in EVALS:
        ranks = []
        for path in sorted((tmp / name).glob("eval.rank*.json")):
            validations = json.loads(path.read_text())
            assert len(validations) == 1, path  # before training only
            ranks.append(validations[0])
        with (tmp / name / "run" / "metrics.csv").open() as f:
            (logged,) = [r for r in csv.DictReader(f) if r["step"] == "0"]
        out[name] = ({k: float(v) for k, v in logged.items() if k.startswith("eval/")}, ranks)
    return out


def real_rows(batches: list[dict]) -> list[int]:
    return [r for b in batches for r in b["batch"] if r >= 0]


def success_by_row(batches: list[dict], temperature_zero: bool) -> dict[int, list[float]]:
    """Each evaluated row's episode successes, from the rollout calls of batches with real rows."""
    out: dict[int, list[float]] = {}
    for b in batches:
        rows = [r for r in b["batch"] if r >= 0]
        if not rows:
            continue
        for call in b["calls"]:
            if (call["temperature"] == 0.0) != temperature_zero:
                continue
            per_row = len(call["success"]) // len(call["rows"])
            for i, row in enumerate(call["rows"]):
                if row in rows:
                    out.setdefault(row, []).extend(call["success"][i * per_row : (i + 1) * per_row])
    return out


@pytest.mark.slow
@pytest.mark.xdist_group(name="eval_ranks")
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])  # fsdp: every rollout is a collective
def test_three_process_eval_counts_every_row_once_and_matches_one_process(evaluations, strategy):
    one, (solo,) = evaluations["one"]
    three, ranks = evaluations[f"three_{strategy}"]
    assert len(ranks) == 3
    per_rank = [r["batches"] for r in ranks]
    # Each row evaluated exactly once over all ranks; the one process saw every row once too.
    assert sorted(r for batches in per_rank for r in real_rows(batches)) == list(range(EVAL_ROWS))
    assert sorted(real_rows(solo["batches"])) == list(range(EVAL_ROWS))
    # Rank-safe: the same number of batches and of rollout calls on every rank.
    assert len({len(batches) for batches in per_rank}) == 1
    assert len({sum(len(b["calls"]) for b in batches) for batches in per_rank}) == 1
    # Greedy: the same episodes as one process, row by row, and the same accuracy, exactly.
    greedy_one = success_by_row(solo["batches"], temperature_zero=True)
    greedy_three: dict[int, list[float]] = {}
    for batches in per_rank:
        greedy_three.update(success_by_row(batches, temperature_zero=True))
    assert greedy_three == greedy_one and len(greedy_one) == EVAL_ROWS
    expected = float(np.float32(sum(v[0] for v in greedy_one.values()) / EVAL_ROWS))  # k/20, not k/21
    assert one["eval/accuracy_greedy"] == solo["metrics"]["eval/accuracy_greedy"] == expected
    assert three["eval/accuracy_greedy"] == expected
    assert all(r["metrics"] == ranks[0]["metrics"] for r in ranks)  # every rank holds the global value
    # Sampled (other random numbers per rank): still over the 20 rows' episodes, each once.
    by_row: dict[int, list[float]] = {}
    for batches in per_rank:
        by_row.update(success_by_row(batches, temperature_zero=False))
    assert sorted(by_row) == list(range(EVAL_ROWS)) and all(len(v) == 2 for v in by_row.values())
    sampled = [s for v in by_row.values() for s in v]
    assert three["eval/accuracy_sampled"] == float(np.float32(sum(sampled) / (2 * EVAL_ROWS)))
    assert three["eval/pass@1"] == float(np.float32(sum(sum(v) / 2 for v in by_row.values()) / EVAL_ROWS))
    assert three["eval/pass@2"] == float(np.float32(sum(max(v) for v in by_row.values()) / EVAL_ROWS))
    assert per_rank[2][-1]["batch"] == [PAD_ROW]  # the short rank ran a padding batch (uncounted)


def test_info_metrics_are_per_turn_means_of_the_eval_episodes():
    """eval.info_metrics=[valid_move]: every turn's info value, summed and counted like the other
    eval metrics (non-numbers left out), under the same padding rule."""

    class WithMoves(_Evaluation):
        def generate(self, rows, params, *, group_size, evaluation=False):
            result = super().generate(rows, params, group_size=group_size, evaluation=evaluation)
            for t in result.trajectories:  # two turns: one valid move, then a valid one when correct
                t.infos = [{"valid_move": True}, {"valid_move": t.infos[0]["correct"], "note": "x"}]
            return result

    module, padding = WithMoves(), WithMoves()
    module.eval_info_metrics = padding.eval_info_metrics = ("valid_move", "note")
    for m, batch in ((module, [2, 5]), (padding, [PAD_ROW])):
        m.on_validation_epoch_start()
        m.validation_step(torch.tensor(batch), 0)
    # greedy: rows 2 (correct) and 5 (not): turns 1, 1, 1, 0 -> 3 of 4; sampled: 4 episodes -> 6 of 8
    assert module._eval_totals["eval/env_valid_move_greedy"].tolist() == [3.0, 4.0]
    assert module._eval_totals["eval/env_valid_move_sampled"].tolist() == [6.0, 8.0]
    assert module._eval_totals["eval/env_note_greedy"].tolist() == [0.0, 0.0]  # a string: not counted
    assert sorted(padding._eval_totals) == sorted(module._eval_totals)
    assert all(v.tolist() == [0.0, 0.0] for v in padding._eval_totals.values())
