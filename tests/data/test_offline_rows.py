"""SFT and DPO rows are checked when the data module reads them: a missing column names the
``algo.*_key`` field that should name it (it was a bare ``KeyError``), preference pairs with the
same reply twice are dropped with one warning (a file of nothing else is refused), and held-out
rows that are also training rows (duplicates in the file) are warned about."""

from __future__ import annotations

import json
import logging

import pytest

from rlhf_lightning.config import ASSETS
from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.data.offline import OfflineDataModule
from rlhf_lightning.rollout.episodes.harness import ChatFormatter

KEYS = {k: k for k in ("messages", "prompt", "completion", "chosen", "rejected")}


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def module(tokenizer, kind, path, keys=KEYS, **kwargs):
    return OfflineDataModule(
        kind, path, ChatFormatter(tokenizer), dict(keys), batch_size=2, max_len=128, **kwargs
    )


def test_sft_rows_without_their_columns_name_the_key_fields(tiny_tokenizer, tmp_path):
    path = write_rows(tmp_path / "sft.jsonl", [{"question": "1+1?", "answer": "2"}] * 2)
    with pytest.raises(ConfigError) as err:
        module(tiny_tokenizer, "sft", path)
    message = str(err.value)
    assert message.startswith("invalid config: algo.prompt_key='prompt': a column of every row of")
    assert "row 0 has ['answer', 'question']" in message
    assert "set algo.messages_key (chat rows), or algo.prompt_key and algo.completion_key" in message
    renamed = {**KEYS, "prompt": "question", "completion": "answer"}
    assert len(module(tiny_tokenizer, "sft", path, renamed, eval_fraction=0.5).train_rows) == 1


def test_a_later_row_missing_a_preference_column_is_named_by_row(tiny_tokenizer, tmp_path):
    rows = [{"prompt": "q", "chosen": "a", "rejected": "b"}, {"prompt": "q2", "chosen": "a"}]
    path = write_rows(tmp_path / "dpo.jsonl", rows)
    with pytest.raises(
        ConfigError, match=r"algo\.rejected_key='rejected': .*row 1 has \['chosen', 'prompt'\]"
    ):
        module(tiny_tokenizer, "preference", path)


def test_preference_pairs_with_the_same_reply_twice_are_dropped_with_one_warning(
    tiny_tokenizer, tmp_path, caplog
):
    """They train nothing, and real preference sets (HH-RLHF) hold a few: the file is not
    refused for them (it was, whole); one warning per file gives the count and the first row."""
    rows = [
        {"prompt": "q0", "chosen": "a", "rejected": "b"},
        {"prompt": "q1", "chosen": "7", "rejected": "7"},
        {"prompt": "q2", "chosen": "c", "rejected": "d"},
        {"prompt": "q3", "chosen": "8", "rejected": "8"},
    ]
    path = write_rows(tmp_path / "dpo.jsonl", rows)
    eval_path = write_rows(tmp_path / "eval.jsonl", [rows[3], rows[2]])
    with caplog.at_level(logging.WARNING, logger="rlhf_lightning.data.offline"):
        dm = module(tiny_tokenizer, "preference", path, eval_path=eval_path)
    assert dm.train_rows == [rows[0], rows[2]]
    assert dm.eval_rows == [rows[2]]
    assert [len(pair) for pair in (dm.train_set[0], dm.train_set[1], dm.eval_set[0])] == [2, 2, 2]
    warnings = [r.getMessage() for r in caplog.records if "chosen and rejected" in r.getMessage()]
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith(f"dropped 2 of 4 preference rows of {path} (algo.data_path) ")
    assert warnings[0].endswith("the first is row 1 (counting from 0): '7'")
    assert warnings[1].startswith(f"dropped 1 of 2 preference rows of {eval_path} (algo.eval_data_path) ")
    assert warnings[1].endswith("the first is row 0 (counting from 0): '8'")


def test_a_preference_file_of_identical_pairs_only_is_refused_naming_why(tiny_tokenizer, tmp_path):
    rows = [{"prompt": "q", "chosen": "a", "rejected": "b"}]
    same = [
        {"prompt": "q1", "chosen": "7", "rejected": "7"},
        {"prompt": "q2", "chosen": "8", "rejected": "8"},
    ]
    with pytest.raises(
        ConfigError,
        match=r"algo\.data_path=.*all 2 rows have the same chosen and rejected reply \(the first is "
        r"row 0 \(counting from 0\): '7'\)",
    ):
        module(tiny_tokenizer, "preference", write_rows(tmp_path / "dpo.jsonl", same))
    with pytest.raises(ConfigError, match=r"algo\.eval_data_path=.*all 2 rows have the same chosen"):
        module(
            tiny_tokenizer,
            "preference",
            write_rows(tmp_path / "ok.jsonl", rows),
            eval_path=write_rows(tmp_path / "eval.jsonl", same),
        )


def test_duplicate_rows_that_land_in_both_splits_are_warned_about(tiny_tokenizer, tmp_path, caplog):
    rows = [{"prompt": f"q{i}", "completion": str(i)} for i in range(8)]
    rows += [rows[0], rows[3]]  # the last 10% (one row) is held out: a copy of row 3
    path = write_rows(tmp_path / "sft.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="rlhf_lightning.envs.files"):
        dm = module(tiny_tokenizer, "sft", path)
    assert dm.eval_rows == [rows[3]]
    assert "1 of 1 held-out rows" in caplog.text and "also training rows" in caplog.text


@pytest.mark.parametrize(
    ("kind", "name"), [("sft", "sft_arithmetic.jsonl"), ("preference", "dpo_arithmetic.jsonl")]
)
def test_the_shipped_files_pass_the_row_checks(tiny_tokenizer, kind, name, caplog):
    """They pass; the shipped SFT sample repeats a few problems, and the warning counts exactly
    the held-out rows that also appear among the training rows (counted here from the lines)."""
    lines = [line for line in (ASSETS / name).read_text().splitlines() if line.strip()]
    cut = max(1, int(len(lines) * 0.9))
    train = {json.dumps(json.loads(line), sort_keys=True) for line in lines[:cut]}
    shared = sum(json.dumps(json.loads(line), sort_keys=True) in train for line in lines[cut:])
    with caplog.at_level(logging.WARNING, logger="rlhf_lightning.envs.files"):
        dm = module(tiny_tokenizer, kind, str(ASSETS / name))
    assert (len(dm.train_rows), len(dm.eval_rows)) == (cut, len(lines) - cut)
    if shared:
        assert f"{shared} of {len(lines) - cut} held-out rows" in caplog.text
    else:
        assert "also training rows" not in caplog.text
