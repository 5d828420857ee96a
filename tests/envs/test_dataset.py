"""env=dataset (Hugging Face datasets: Hub ids or local files) and the gsm8k / math500 presets,
offline on local fixtures in the same schemas."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.envs.dataset import (
    DatasetEnv,
    after_hashes,
    checked_golds,
    holdout,
    last_boxed,
    load_rows,
    prepared_splits,
)
from rlhf_lightning.run import run
from rlhf_lightning.run.validation import validate
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
    env = DatasetEnv(str(train), eval_split=None, answer_extractor="builtins.str.upper")
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


def test_each_split_is_loaded_and_checked_once_per_process(gsm8k_files):
    train, test = gsm8k_files
    for cached in (load_rows, checked_golds, prepared_splits):
        cached.cache_clear()
    for _ in range(5):  # the harness builds one env per episode
        DatasetEnv(str(train), eval_path=str(test), eval_split="train")
    assert load_rows.cache_info().misses == 2  # train and eval read once each
    assert checked_golds.cache_info().misses == 2  # and their rows checked once each
    assert (prepared_splits.cache_info().misses, prepared_splits.cache_info().hits) == (1, 4)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def questions(env: DatasetEnv, evaluation: bool) -> list[str]:
    return [str(env.reset(row_index=i, evaluation=evaluation)[0]) for i in range(env.num_rows(evaluation))]


@pytest.mark.parametrize("eval_split", ["auto", None])
def test_one_local_file_holds_out_eval_rows_that_are_never_trained_on(tmp_path, eval_split):
    path = write_parquet(tmp_path / "rows.parquet", gsm8k_rows(60))
    env = DatasetEnv(str(path), eval_split=eval_split)  # auto is the default (env=dataset's too)
    train, evals = questions(env, False), questions(env, True)
    assert (len(train), len(evals)) == (54, 6)  # round(60 * 0.1) held out
    assert not set(train) & set(evals)
    everything = [r["question"] for r in gsm8k_rows(60)]
    assert sorted(train + evals) == sorted(everything)
    assert train == [q for q in everything if q in train] and evals == [q for q in everything if q in evals]
    assert evals != everything[-6:]  # a fixed pseudo-random subset, not the file's tail
    held = sorted(holdout(60, 0.1))
    assert evals == [everything[i] for i in held] and held == sorted(holdout(60, 0.1))
    assert questions(DatasetEnv(str(path)), True) == evals  # the same every time (and on every rank)


def test_holdout_sizes():
    assert [len(holdout(n, 0.1)) for n in (2, 5, 10, 60, 1000)] == [1, 1, 1, 6, 100]
    assert len(holdout(4, 0.9)) == 3  # at least one training row


def test_settings_that_would_evaluate_on_training_rows_are_refused(gsm8k_files, tmp_path):
    train, test = gsm8k_files
    with pytest.raises(
        ConfigError,
        match=r"eval_split='test': auto or null when env\.kwargs\.path is one local file .*a file has a "
        r"single split, so 'test' would be its training rows\. Set env\.kwargs\.eval_path=FILE",
    ):
        DatasetEnv(str(train), eval_split="test")
    with pytest.raises(
        ConfigError, match=r"eval rows other than the training rows: .* is the train split itself"
    ):
        DatasetEnv(str(train), eval_path=str(train))
    with pytest.raises(
        ConfigError,
        match=r"eval_split=None: .*null holds out rows of the train split and would ignore eval_path",
    ):
        DatasetEnv(str(train), eval_path=str(test), eval_split=None)
    with pytest.raises(ConfigError, match=r"eval_fraction=0\.0: a fraction in \(0, 1\)"):
        DatasetEnv(str(train), eval_fraction=0.0)


def test_a_dataset_directory_evaluates_on_its_test_split(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "train.jsonl", gsm8k_rows(6))
    write_jsonl(data / "test.jsonl", gsm8k_rows(3, offset=50))
    env = DatasetEnv(str(data))
    assert (env.num_rows(False), env.num_rows(True)) == (6, 3)
    with pytest.raises(ConfigError, match=r"is the train split itself"):
        DatasetEnv(str(data), eval_split="train")


def test_rows_without_a_usable_gold_answer_are_counted_and_refused(tmp_path):
    rows = [dict(r) for r in gsm8k_rows(60)]
    rows[7]["answer"] = None
    rows[20] = {"question": rows[20]["question"]}  # no answer key at all in this JSON line
    rows[33]["question"] = None
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    with pytest.raises(ConfigError) as err:
        DatasetEnv(str(path))
    message = str(err.value)
    assert f"3 of 60 rows of {path} have none (2 with answer=None; 1 with question=None)" in message
    assert "the first is row 7, with answer=None. Drop or fix those rows" in message
    nulls = write_jsonl(tmp_path / "nulls.jsonl", [{"question": "q", "answer": None}] * 5)
    with pytest.raises(ConfigError, match=r"5 of 5 rows .* with answer=None"):
        DatasetEnv(str(nulls))  # the old check read rows[0]'s keys only: every gold was 'None'


def test_empty_gold_answers_and_non_integer_golds_for_scorer_integer_are_refused(tmp_path):
    rows = gsm8k_rows(10)
    rows[4] = {**rows[4], "answer": "no marker, so the whole text\n#### "}
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    with pytest.raises(ConfigError, match=r"1 of 10 rows .*the first is row 4, with an empty gold answer"):
        DatasetEnv(str(path), answer_extractor="gsm8k")
    frac = write_jsonl(tmp_path / "frac.jsonl", [{"question": f"q{i}", "answer": f"{i}/2"} for i in range(6)])
    with pytest.raises(
        ConfigError,
        match=r"6 of 6 rows .*the first is row 0, with a gold answer that is not an integer \('0/2'\) for "
        r"scorer=integer\..*or use env\.kwargs\.scorer=math_verify",
    ):
        DatasetEnv(str(frac), scorer="integer")
    assert DatasetEnv(str(frac)).num_rows(False) == 5  # math_verify takes fractions


def test_an_extractor_that_returns_a_non_string_is_named(gsm8k_files):
    train, _ = gsm8k_files
    with pytest.raises(
        ConfigError,
        match=r"env\.kwargs\.answer_extractor='builtins\.len': a function str -> str: answer_extractor must "
        r"return str, and it returned int \d+ for row 0",
    ):
        DatasetEnv(str(train), answer_extractor="builtins.len")
    with pytest.raises(
        ConfigError, match=r"answer_extractor='builtins\.int': .*it raised ValueError: .* on row 0"
    ):
        DatasetEnv(str(train), answer_extractor="builtins.int")


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_a_file_that_is_not_utf8_is_named_with_the_fix(tmp_path, suffix):
    path = tmp_path / f"latin1{suffix}"
    if suffix == ".jsonl":
        path.write_bytes(
            '{"question": "1+1?", "answer": "2"}\n{"question": "café?", "answer": "1"}\n'.encode("latin-1")
        )
    else:
        path.write_bytes("question,answer\n1+1?,2\ncafé?,1\n".encode("latin-1"))
    with pytest.raises(ConfigError) as err:
        DatasetEnv(str(path))
    message = str(err.value)
    line = 2 if suffix == ".jsonl" else 3
    assert f"a UTF-8 encoded file: {path} is not valid UTF-8 (line {line}, byte " in message
    assert "Convert it to UTF-8, e.g. iconv -f latin1 -t utf-8" in message


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".parquet", ".json"])
def test_an_empty_file_is_named(tmp_path, suffix):
    path = tmp_path / f"empty{suffix}"
    path.write_text("\n\n" if suffix == ".jsonl" else "")
    with pytest.raises(ConfigError, match=rf"a data file with rows: {path} is empty"):
        DatasetEnv(str(path))


def test_a_file_with_no_rows_or_in_another_format_is_named(tmp_path):
    header = tmp_path / "header.csv"
    header.write_text("question,answer\n")
    with pytest.raises(ConfigError, match=rf"a data file with rows: {header} has no rows"):
        DatasetEnv(str(header))
    broken = tmp_path / "broken.parquet"
    broken.write_text("question,answer\n1,2\n")
    with pytest.raises(
        ConfigError, match=rf"a parquet file that datasets.load_dataset reads: {broken} fails with"
    ):
        DatasetEnv(str(broken))
    with pytest.raises(ConfigError, match=r"an existing file or directory: there is none"):
        DatasetEnv(str(tmp_path / "missing.parquet"))


def test_reset_hands_out_copies_of_the_cached_row(tmp_path):
    rows = [{"question": f"q{i}", "answer": str(i), "steps": [i], "meta": {"tags": ["a"]}} for i in range(10)]
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    for _ in range(3):
        _, info = DatasetEnv(str(path)).reset(row_index=1)
        assert info["steps"] == [1] and info["meta"] == {"tags": ["a"]}
        info["steps"].append(99)
        info["meta"]["tags"].append("b")
