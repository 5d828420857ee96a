"""env=dataset (Hugging Face datasets: Hub ids or local files) and the gsm8k / math500 presets,
offline on local fixtures in the same schemas."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhf_lightning.envs.dataset import DatasetEnv, after_hashes, last_boxed, load_rows
from rlhf_lightning.run import run
from rlhf_lightning.validation import ConfigError, validate
from tests.conftest import FAST, compose_config


def gsm8k_rows(n: int, offset: int = 0) -> list[dict[str, str]]:
    """Rows in GSM8K's schema: question, and a worked answer ending in ``#### n``."""
    rows = []
    for i in range(offset, offset + n):
        a, b = 10 + i, 20 + 2 * i
        rows.append(
            {
                "question": f"Sam has {a} pens and gets {b} more. How many pens does Sam have?",
                "answer": f"Sam has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} pens.\n#### {a + b}",
            }
        )
    return rows


def write_parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture
def gsm8k_files(tmp_path: Path) -> tuple[Path, Path]:
    return (
        write_parquet(tmp_path / "train.parquet", gsm8k_rows(24)),
        write_parquet(tmp_path / "test.parquet", gsm8k_rows(8, offset=100)),
    )


def test_answer_extractors():
    assert after_hashes("2 + 3 = 5\n#### 1,234") == "1234"
    assert after_hashes("no marker 7") == "no marker 7"
    assert last_boxed("so \\boxed{1} then \\boxed{\\frac{1}{2}} done") == "\\frac{1}{2}"
    assert last_boxed("no box") == "no box"


def test_gsm8k_schema_from_local_parquet(gsm8k_files):
    train, test = gsm8k_files
    env = DatasetEnv(
        str(train), eval_path=str(test), split="train", eval_split="train", answer_extractor="gsm8k"
    )
    assert (env.num_rows(False), env.num_rows(True)) == (24, 8)
    question, info = env.reset(row_index=2)
    assert question.startswith("Sam has 12 pens and gets 24 more.")
    assert info["gold"] == "36" and info["question"] == question  # the row's columns, for reward functions
    assert env.step("12 + 24 = 36, so \\boxed{36}")[1:3] == (1.0, True)
    env.reset(row_index=2)
    assert env.step("\\boxed{35}")[1] == 0.0
    eval_question, _ = env.reset(row_index=0, evaluation=True)
    assert "110 pens" in eval_question


def test_math500_schema_from_local_jsonl_with_boxed_answers_and_a_system_column(tmp_path):
    rows = [
        {"problem": f"Compute {i}/2.", "solution": f"Halve it: $\\boxed{{\\frac{{{i}}}{{2}}}}$.", "answer": "x",
         "sys": "Be brief."}
        for i in range(1, 11)
    ]  # fmt: skip
    path = tmp_path / "math.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    env = DatasetEnv(
        str(path), eval_split=None, eval_fraction=0.2, question_key="problem", answer_key="solution",
        answer_extractor="boxed", system_key="sys", instruction="Box it.",
    )  # fmt: skip
    assert (env.num_rows(False), env.num_rows(True)) == (8, 2)
    messages, info = env.reset(row_index=2)
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Compute 3/2.\nBox it."},
    ]
    assert info["gold"] == "\\frac{3}{2}"
    assert env.step("it is $\\frac{6}{4}$")[1] == 1.0  # math-verify: equivalent forms


def test_streaming_reads_only_max_rows(gsm8k_files):
    train, _ = gsm8k_files
    env = DatasetEnv(str(train), eval_split=None, eval_fraction=0.25, streaming=True, max_rows=8)
    assert (env.num_rows(False), env.num_rows(True)) == (6, 2)
    with pytest.raises(ConfigError, match="max_rows"):
        load_rows(str(train), None, "train", None, True, None)


def test_bad_inputs_are_named(gsm8k_files, tmp_path):
    train, _ = gsm8k_files
    with pytest.raises(ConfigError, match=r"question_key.*'prompt'.*missing.*\['answer', 'question'\]"):
        DatasetEnv(str(train), eval_split=None, question_key="prompt")
    with pytest.raises(ConfigError, match="answer_extractor"):
        DatasetEnv(str(train), eval_split=None, answer_extractor="no.such.fn")
    with pytest.raises(ConfigError, match="scorer"):
        DatasetEnv(str(train), eval_split=None, scorer="fuzzy")
    (tmp_path / "rows.txt").write_text("x")
    with pytest.raises(ConfigError, match="ending in one of"):
        DatasetEnv(str(tmp_path / "rows.txt"))
    # A Hub id without the Hub (the tests run with HF_HUB_OFFLINE=1): the message says what to do.
    with pytest.raises(ConfigError, match=r"point env\.kwargs\.path at the local files"):
        DatasetEnv("openai/gsm8k", name="main")


def test_a_custom_answer_extractor_by_dotted_path(gsm8k_files):
    train, _ = gsm8k_files
    env = DatasetEnv(str(train), eval_split=None, answer_extractor="builtins.str.upper", scorer="integer")
    _, info = env.reset(row_index=0)
    assert info["gold"] == gsm8k_rows(1)[0]["answer"].upper()  # builtins.str.upper of the answer column


@pytest.mark.parametrize("preset", ["gsm8k", "math500", "dataset"])
def test_presets_compose_and_validate(preset, tmp_path):
    overrides = [f"env={preset}"] + (["env.kwargs.path=openai/gsm8k"] if preset == "dataset" else [])
    cfg = compose_config(overrides, output_dir=tmp_path)
    validate(cfg)
    assert cfg.env._target_ == "rlhf_lightning.envs.dataset.DatasetEnv"
    if preset == "gsm8k":
        assert (cfg.env.kwargs.path, cfg.env.kwargs.name, cfg.env.kwargs.answer_extractor) == (
            "openai/gsm8k", "main", "gsm8k",
        )  # fmt: skip
    if preset == "math500":
        assert cfg.env.kwargs.eval_path == "HuggingFaceH4/MATH-500"


@pytest.mark.slow
def test_train_from_a_local_parquet_in_gsm8k_schema(gsm8k_files, tmp_path):
    train, test = gsm8k_files
    cfg = compose_config(
        [*[o for o in FAST if not o.startswith("env.")], "env=gsm8k", f"env.kwargs.path={train}",
         f"env.kwargs.eval_path={test}", "env.kwargs.eval_split=train", "env.kwargs.name=null",
         "env.kwargs.scorer=integer", "env.kwargs.instruction=''", "eval.batch_size=8",
         "trainer.max_steps=2", "checkpoint.every_n_steps=0"],
        output_dir=tmp_path / "run",
    )  # fmt: skip
    run(cfg)
    rows = list(csv.DictReader((tmp_path / "run" / "metrics.csv").open()))
    assert sum(1 for r in rows if r.get("rollout/reward_mean")) == 2
    evals = [r for r in rows if r.get("eval/accuracy_greedy")]
    assert evals and all(0.0 <= float(r["eval/accuracy_greedy"]) <= 1.0 for r in evals)


def test_each_split_is_loaded_once_per_process(gsm8k_files):
    train, test = gsm8k_files
    load_rows.cache_clear()
    for _ in range(5):  # the harness builds one env per episode
        DatasetEnv(str(train), eval_path=str(test), eval_split="train")
    info = load_rows.cache_info()
    assert (info.misses, info.hits) == (2, 8)  # train and eval read once each
