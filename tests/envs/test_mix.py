"""env=mix: rows by weight (a fixed interleave, counted against its bound) and by a route column,
per-member training metrics and evaluation, eval rows that are never training rows, refusals of
what cannot mix, an exact resume and a sweep over the weights."""

from __future__ import annotations

import csv
import json
import pickle
from fractions import Fraction
from pathlib import Path
from typing import Any, ClassVar

import pytest
from omegaconf import OmegaConf

from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.envs.factory import env_factory
from rlhf_lightning.envs.mix import MIX_KEY, MixEnv, build_plan
from rlhf_lightning.run import run
from tests.conftest import compose_config, fit_recording

ARITH = "rlhf_lightning.envs.arithmetic.ArithmeticEnv"
DATASET = "rlhf_lightning.envs.dataset.DatasetEnv"
# Small but real: 4 prompts x 2 samples; 6 + 4 eval rows (arithmetic, guess_number).
QUICK = [
    "env=mix",
    "algo.prompts_per_step=4",
    "algo.group_size=2",
    "trainer.enable_progress_bar=false",
    "env.kwargs.envs.add.kwargs.eval_size=6",
    "env.kwargs.envs.guess.kwargs.eval_size=4",
    "eval.batch_size=10",
    "num_threads=1",
]


def arith(train_size: int = 1000, eval_size: int = 5, **node: Any) -> dict[str, Any]:
    return {"_target_": ARITH, "kwargs": {"train_size": train_size, "eval_size": eval_size}, **node}


class Recorder:
    """A member that records every reset: (evaluation, row)."""

    resets: ClassVar[list[tuple[bool, int]]] = []

    def __init__(self, train_size: int = 10, eval_size: int = 3, max_turns: int = 9) -> None:
        self.train_size, self.eval_size, self.max_turns = train_size, eval_size, max_turns

    def num_rows(self, evaluation: bool) -> int:
        return self.eval_size if evaluation else self.train_size

    def reset(self, seed=None, *, row_index=None, evaluation=False):
        Recorder.resets.append((evaluation, row_index))
        return f"{'eval' if evaluation else 'train'} {row_index}", {}

    def step(self, action):  # never ends by itself before its max_turns
        return "again", 0.5, False, False, {"score": 2}


RECORDER = f"{__name__}.Recorder"


def expected_map(weights: dict[str, int], rows: int, sizes: dict[str, int]) -> list[tuple[str, int]]:
    """The interleave by its definition, without periods: every member's k-th row at time
    (k + 1/2) / w, all members' times merged (ties: the member named first); row j of a member is
    its train row j mod its size."""
    order = list(weights)
    events = sorted(
        (Fraction(2 * k + 1, 2 * w), order.index(n), n, k)
        for n, w in weights.items()
        if w
        for k in range(rows)
    )[:rows]
    return [(n, k % sizes[n]) for _, _, n, k in events]


@pytest.mark.parametrize(
    "weights, ints",
    [({"a": 1, "b": 3}, {"a": 1, "b": 3}), ({"a": 0.2, "b": 0.5, "c": 0.3}, {"a": 2, "b": 5, "c": 3})],
)
def test_rows_by_weight_match_the_weights_within_the_interleaves_bound(weights, ints):
    sizes = {"a": 7, "b": 1000, "c": 50}
    nodes = {n: arith(train_size=sizes[n]) for n in weights}
    plan = build_plan(nodes, weights=weights, train_size=10_000)
    assert plan.weights == ints
    total, m = sum(ints.values()), len(ints)
    rows = [plan.locate(i, evaluation=False) for i in range(3000)]
    assert rows == expected_map(ints, 3000, sizes)
    counts = dict.fromkeys(ints, 0)
    for n, (name, _) in enumerate(rows, start=1):
        counts[name] += 1
        for member, w in ints.items():
            # within (1 + M w / W) / 2 of n w / W after any n rows; exactly at whole periods
            assert abs(counts[member] - n * w / total) <= (1 + m * w / total) / 2 + 1e-12
            if n % total == 0:
                assert counts[member] == n * w // total
    # each member's rows come in its own order, cycling when the member has fewer rows
    for member in ints:
        assert [r for name, r in rows if name == member] == [j % sizes[member] for j in range(counts[member])]
    # the default size: the member with the most rows per unit of weight passes once
    default = build_plan(nodes, weights=weights).train_size
    assert default == max(-(-sizes[n] * total // w) for n, w in ints.items())


def test_the_row_map_is_a_pure_function_of_the_row():
    envs = {"a": arith(), "b": {"_target_": RECORDER, "kwargs": {"train_size": 30}}}
    one, two = MixEnv(envs, weights={"a": 2, "b": 1}), MixEnv(envs, weights={"a": 0.5, "b": 0.25})
    rows = [977, 3, 3, 512, 0, 1999, 2]
    first = [one.reset(row_index=r)[0] for r in rows]
    assert [two.reset(row_index=r)[0] for r in reversed(rows)] == first[::-1]
    copied = pickle.loads(pickle.dumps(one))  # a step worker process gets a pickled copy
    assert [copied.reset(row_index=r)[0] for r in rows] == first
    assert one.reset(seed=512)[0] == first[3]  # no row_index: the seed is the row
    assert one.reset(row_index=one.num_rows(False) + 977)[0] == first[0]  # the next epoch's rows


def test_eval_rows_are_each_members_own_eval_rows_never_training_rows():
    envs = {
        "r": {"_target_": RECORDER, "kwargs": {"train_size": 10, "eval_size": 3}},
        "a": arith(train_size=4, eval_size=2),
    }
    env = MixEnv(envs, weights={"r": 1, "a": 1})
    assert env.num_rows(True) == 5 and env.num_rows(False) == 20
    Recorder.resets.clear()
    for row in range(env.num_rows(False)):
        env.reset(row_index=row)
    assert all(not ev and 0 <= r < 10 for ev, r in Recorder.resets) and len(Recorder.resets) == 10
    Recorder.resets.clear()
    infos = [env.reset(row_index=row, evaluation=True)[1][MIX_KEY] for row in range(5)]
    assert infos == ["r", "r", "r", "a", "a"] and Recorder.resets == [(True, 0), (True, 1), (True, 2)]
    arithmetic = env.plan.members["a"].factory()
    assert [env.reset(row_index=3 + j, evaluation=True)[0] for j in range(2)] == [
        arithmetic.reset(row_index=j, evaluation=True)[0] for j in range(2)
    ]


def test_a_step_passes_the_members_infos_on_and_again_under_its_name():
    env = MixEnv(
        {"r": {"_target_": RECORDER, "kwargs": {"max_turns": 9}, "max_turns": 2}, "a": arith()},
        weights={"r": 1, "a": 3},
    )
    env.reset(row_index=1)  # period a, r, a, a
    assert env.name == "r"
    _, reward, term, trunc, info = env.step("x")
    assert (reward, term, trunc) == (0.5, False, False)
    assert info == {"score": 2, "r/score": 2, "r/reward": 0.5, "r/share": 1.0, "a/share": 0.0}
    _, _, term, trunc, info = env.step("x")  # the member's own max_turns (2) ends it
    assert (term, trunc) == (False, True) and info["r/return"] == 1.0 and "r/share" not in info
    env.reset(row_index=0)
    answer = env.member.problem.answer
    _, reward, term, _, info = env.step(str(answer))
    assert (reward, term) == (1.0, True)
    assert info == {
        "correct": True,
        "a/correct": True,
        "a/reward": 1.0,
        "a/return": 1.0,
        "a/share": 1.0,
        "r/share": 0.0,
    }


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_rows_by_route_column_go_to_the_member_they_name(tmp_path):
    rows = [
        {
            "question": f"{'plus' if i % 3 else 'times'} {i} {i + 1}",
            "answer": str(2 * i + 1 if i % 3 else i * (i + 1)),
            "task": "plus" if i % 3 else "times",
        }
        for i in range(30)
    ]
    data = write_jsonl(tmp_path / "mixed.jsonl", rows)

    def member(instruction: str) -> dict[str, Any]:
        kwargs = {"scorer": "integer", "instruction": instruction, "eval_fraction": 0.2, "path": "???"}
        return {"_target_": DATASET, "kwargs": kwargs}

    env = MixEnv({"plus": member("ADD"), "times": member("MUL")}, route="task", path=str(data))
    by_task = {t: {r["question"] for r in rows if r["task"] == t} for t in ("plus", "times")}
    assert env.num_rows(False) + env.num_rows(True) == 30
    seen: dict[tuple[str, bool], list[str]] = {}
    for evaluation in (False, True):
        for row in range(env.num_rows(evaluation)):
            obs, info = env.reset(row_index=row, evaluation=evaluation)
            question, instruction = obs.split("\n")
            assert (
                instruction == {"plus": "ADD", "times": "MUL"}[info[MIX_KEY]]
                and info["task"] == info[MIX_KEY]
            )
            seen.setdefault((info[MIX_KEY], evaluation), []).append(question)
            _, reward, _, _, step_info = env.step(info["answer"])
            assert reward == 1.0 and step_info[f"{info[MIX_KEY]}/correct"] is True
    for task, questions in by_task.items():
        train, held = seen[(task, False)], seen[(task, True)]
        assert set(train).isdisjoint(held) and set(train) | set(held) == questions
        assert len(train) == len(set(train)) and len(held) == round(len(questions) * 0.2)
    # the mix's train rows: plus's, then times's
    assert [env.reset(row_index=r)[1][MIX_KEY] for r in range(env.num_rows(False))] == (
        ["plus"] * len(seen[("plus", False)]) + ["times"] * len(seen[("times", False)])
    )
    with pytest.raises(ConfigError, match=r"env.kwargs.route.*row 1 has task='plus'"):
        MixEnv({"times": member("MUL")}, route="task", path=str(data))
    with pytest.raises(ConfigError, match=r"env.kwargs.envs.plus.kwargs.path.*unset"):
        MixEnv(
            {"plus": {**member("ADD"), "kwargs": {"path": str(data)}}, "times": member("MUL")},
            route="task",
            path=str(data),
        )
    with pytest.raises(ConfigError, match=r"exactly one of env\.kwargs\.weights"):
        MixEnv({"plus": member("ADD")}, weights={"plus": 1}, route="task", path=str(data))


def mix_factory(*overrides: str):
    cfg = compose_config(["env=mix", *overrides])
    return cfg, env_factory(cfg.env._target_, OmegaConf.to_container(cfg.env.kwargs, resolve=True))


def test_what_cannot_mix_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match=r"env.kwargs.weights.*one weight per member"):
        mix_factory("~env.kwargs.weights.guess")
    cfg, factory = mix_factory("env.kwargs.envs.guess.max_turns=7")
    with pytest.raises(ConfigError, match=r"env.max_turns=5.*env.kwargs.envs.guess.max_turns=7"):
        factory.check_harness(cfg.env)
    cfg, factory = mix_factory("env.kwargs.envs.add.concurrency=4")
    with pytest.raises(ConfigError, match=r"env.kwargs.envs.add.concurrency=4.*env.concurrency=1"):
        factory.check_harness(cfg.env)
    cfg, factory = mix_factory("env.kwargs.envs.add.max_model_len=1024")
    with pytest.raises(
        ConfigError, match=r"env.kwargs.envs.add.max_model_len=1024.*at most env.max_model_len=512"
    ):
        factory.check_harness(cfg.env)
    cfg, factory = mix_factory("env.kwargs.envs.guess.max_turns=3", "env.kwargs.weights.add=0.5")
    factory.check_harness(cfg.env)  # shorter member turns and fractional weights are fine
    assert factory.plan.weights == {"add": 1, "guess": 2}


SCORED: list[list[str]] = []  # the members per_member_reward was called with, per call


def per_member_reward(prompts, completions, mix_env, **kwargs) -> list[float]:
    """A reward function per member: 0.25 for an arithmetic episode, 0 for a guessing one."""
    SCORED.append(list(mix_env))
    return [0.25 if m == "add" else 0.0 for m in mix_env]


def test_training_logs_each_members_infos_and_share_and_rewards_see_the_member(tmp_path):
    fn = ["reward=function", "reward.sources=[env,function]", f"reward.fn={__name__}.per_member_reward"]
    cfg = compose_config([*QUICK, *fn, "reward.fn_timeout_s=null", f"output_dir={tmp_path}"])
    SCORED.clear()
    _, _, results, _ = fit_recording(cfg, tmp_path, steps=2)
    assert len(SCORED) == 2
    for result, scored in zip(results, SCORED):
        trajs, metrics = result.trajectories, result.metrics
        played = [t.task_info[MIX_KEY] for t in trajs]
        assert scored == played
        for t, member in zip(trajs, played):  # the function's score on the last turn, over the env's
            assert t.rewards[-1] - t.env_rewards[-1] == pytest.approx(
                0.25 if member == "add" else 0.0, abs=1e-6
            )
        for name in ("add", "guess"):
            mine = [t for t, p in zip(trajs, played) if p == name]
            assert metrics[f"env/{name}/share"] == pytest.approx(len(mine) / len(trajs), abs=1e-12)
            if not mine:
                continue
            rewards = [r for t in mine for r in t.env_rewards]  # the member's own, in its infos
            assert metrics[f"env/{name}/reward"] == pytest.approx(sum(rewards) / len(rewards), abs=1e-12)
        adds = [t for t, p in zip(trajs, played) if p == "add"]
        if adds:
            correct = [float(t.infos[-1]["correct"]) for t in adds]
            assert metrics["env/add/correct"] == pytest.approx(sum(correct) / len(correct), abs=1e-12)
    assert any("env/guess/turns" in r.metrics for r in results)  # guess_number's own info, by name


def test_evaluation_scores_each_member_on_its_own_episodes(tmp_path):
    import lightning as L

    from rlhf_lightning.algorithms.evaluation import episode_success
    from rlhf_lightning.run import build

    cfg = compose_config([*QUICK, "eval.num_samples=2", f"output_dir={tmp_path}"])
    L.seed_everything(cfg.seed)
    module, dm = build(cfg, tmp_path)
    seen: list[tuple[list[int], float, Any]] = []
    generate = module.source.generate

    def spy(rows, params, **kwargs):
        out = generate(rows, params, **kwargs)
        seen.append((list(rows), params.temperature, out))
        return out

    module.source.generate = spy
    trainer = L.Trainer(
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False
    )
    trainer.validate(module, datamodule=dm)
    logged = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert sorted(r for rows, temp, _ in seen if temp == 0.0 for r in rows) == list(
        range(10)
    )  # 6 + 4 eval rows
    for mode, greedy in (("greedy", True), ("sampled", False)):
        trajs = [t for _, temp, out in seen if (temp == 0.0) == greedy for t in out.trajectories]
        assert len(trajs) == 10 * (1 if greedy else 2)
        for name, rows in (("add", 6), ("guess", 4)):
            mine = [t for t in trajs if t.task_info[MIX_KEY] == name]
            assert len(mine) == rows * (1 if greedy else 2)
            accuracy = sum(episode_success(t) for t in mine) / len(mine)
            ret = sum(sum(t.rewards) for t in mine) / len(mine)
            assert logged[f"eval/{name}/accuracy_{mode}"] == pytest.approx(accuracy, abs=1e-6)
            assert logged[f"eval/{name}/return_{mode}"] == pytest.approx(ret, abs=1e-6)
    assert logged["eval/add/return_sampled"] != logged["eval/guess/return_sampled"]  # the split shows


def rows_of(run_dir: Path) -> list[dict[str, str]]:
    with (run_dir / "metrics.csv").open() as f:
        return list(csv.DictReader(f))


def test_the_mixs_evaluation_is_its_members_and_a_sigkill_resume_continues_exactly(tmp_path):
    import os
    import signal
    import sys

    from rlhf_lightning.run import checkpoint_step
    from tests.cli_zygote import ZygotePopen
    from tests.conftest import ROOT
    from tests.test_resume import assert_continues_exactly, env, wait_for

    args = [*QUICK, "trainer.max_steps=8", "trainer.val_check_interval=2", "checkpoint.every_n_steps=2"]
    first, killed = tmp_path / "A", tmp_path / "B"
    assert run(compose_config([*args, "checkpoint.every_n_steps=0", f"output_dir={first}"])).exit_code == 0
    evals = [r for r in rows_of(first) if r.get("eval/accuracy_greedy")]
    assert len(evals) == 5  # steps 0, 2, 4, 6, 8
    for r in evals:
        for mode in (
            "greedy",
            "sampled",
        ):  # the whole mix's values are its members' over their 6 and 4 eval rows
            for key in ("accuracy", "return"):
                members = 6 * float(r[f"eval/add/{key}_{mode}"]) + 4 * float(r[f"eval/guess/{key}_{mode}"])
                assert float(r[f"eval/{key}_{mode}"]) == pytest.approx(members / 10, abs=1e-6)
    # kill -9 once the step-4 checkpoint exists, then resume: every row after the checkpoint as A wrote it
    proc = ZygotePopen(
        [sys.executable, str(ROOT / "train.py"), *args, f"output_dir={killed}"], cwd=tmp_path, env=env()
    )
    wait_for(killed / "checkpoints" / "step_000004.ckpt", proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    step = checkpoint_step(killed / "checkpoints" / "last.ckpt")
    assert 2 <= step <= 6  # killed before its end: the resume has steps to redo
    assert run(compose_config([*args, f"output_dir={killed}", "resume=true"])).exit_code == 0
    assert_continues_exactly(first, killed, after=step)


def test_a_sweep_over_the_weights_runs_each_mix(tmp_path):
    from tests.test_results_and_sweeps import csv_rows, train

    train(
        "-m",
        *QUICK,
        "env.kwargs.weights.add=1,3",
        "trainer.max_steps=1",
        "trainer.val_check_interval=1",
        "name=mixsweep",
        cwd=tmp_path,
    )
    jobs = sorted((tmp_path / "outputs" / "mixsweep" / "multirun").glob("*/*/metrics.csv"))
    assert len(jobs) == 2
    saved = [OmegaConf.load(job.parent / "config.yaml").env.kwargs.weights.add for job in jobs]
    assert sorted(saved) == [1, 3]
    for job in jobs:
        assert any(r.get("env/add/share") for r in csv_rows(job.parent))
