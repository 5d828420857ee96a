"""A local JSON-lines file with a broken line (``env=dataset``) fails naming that line, as the
SFT/DPO and ``env=math`` readers do; Arrow's own message named a 0-based "row" and a column
type change ("changed from string to object"), not the line or the JSON error."""

from __future__ import annotations

import pytest

from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.envs.dataset import DatasetEnv


@pytest.mark.parametrize(
    ("lines", "number", "why"),
    [
        (
            [
                '{"question": "1+1?", "answer": "2"}',
                '{"question": "2+2?", "answer": ',
                '{"question": "3", "answer": "3"}',
            ],
            2,
            "Expecting value, column 32",
        ),
        (
            ['{"question": "1+1?", "answer": "2"}', "", "{question: 1}"],
            3,
            "Expecting property name enclosed in double quotes, column 2",
        ),
    ],
)
def test_a_broken_jsonl_line_is_named_by_its_number(tmp_path, lines, number, why):
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError) as err:
        DatasetEnv(str(path))
    assert str(err.value) == (
        f"invalid config: env.kwargs.path='{path}': a JSON-lines file: line {number} of {path} is not valid "
        f"JSON ({why}); fix or delete that line"
    )


def test_duplicate_rows_held_out_of_a_local_file_are_warned_about(tmp_path, caplog):
    """env=dataset holds out env.kwargs.eval_fraction of a local file's rows; a held-out row
    that repeats a training row is not held out: the warning counts them."""
    import json
    import logging

    from rlhf_lightning.envs.dataset_splits import holdout

    rows = [{"question": f"{i}+1?", "answer": str(i + 1)} for i in range(20)]
    held = sorted(holdout(40, 0.1))  # 4 of the 40 rows written below: the same choice the env makes
    rows = rows + rows  # every row twice: each held-out row has a copy among the training rows
    kept = {i for i in range(40) if i not in held}
    shared = sum(any(rows[k] == rows[h] for k in kept) for h in held)
    path = tmp_path / "twice.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with caplog.at_level(logging.WARNING, logger="rlhf_lightning.envs.files"):
        DatasetEnv(str(path), eval_fraction=0.1)
    assert shared == len(held) == 4
    assert f"{shared} of {len(held)} held-out rows" in caplog.text and "also training rows" in caplog.text
