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
