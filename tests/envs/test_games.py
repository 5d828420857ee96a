"""Each env's rules, scored by hand."""

from __future__ import annotations

import random
import re
import time

import pytest

from rlhf_lightning.envs.base import TextEnv
from rlhf_lightning.envs.files import read_rows
from rlhf_lightning.envs.guess_number import GuessNumberEnv
from rlhf_lightning.envs.math import MathEnv, verify
from rlhf_lightning.envs.sudoku import SudokuEnv, is_valid_grid, solution_grid
from rlhf_lightning.envs.tool_calc import CalcError, ToolCalcEnv, safe_eval


def test_guess_number_feedback_and_rewards():
    env = GuessNumberEnv(low=1, high=20, max_turns=4)
    assert isinstance(env, TextEnv)
    prompt, _ = env.reset(row_index=7)
    assert "between 1 and 20" in prompt
    secret = env.secret
    low = 1 if secret > 1 else 2
    obs, r, done, _, info = env.step(str(low if low != secret else low + 1))
    assert obs in ("Higher.", "Lower.") and r == 0.0 and not done and info["valid"]
    obs, r, done, _, info = env.step("no idea")
    assert r == -0.1 and not info["valid"] and "between 1 and 20" in obs
    obs, r, done, _, info = env.step(f"It is {secret}")
    assert done and info["solved"] and r == pytest.approx(1.0 - 0.1 * 2)
    env.reset(row_index=7)
    for _ in range(4):
        _, _, done, _, _ = env.step("0")
    assert done  # out of guesses
    assert GuessNumberEnv().reset(row_index=3) == GuessNumberEnv().reset(row_index=3)


def test_sudoku_generation_validation_and_solving():
    for seed in range(20):
        assert is_valid_grid(solution_grid(random.Random(seed)))
    env = SudokuEnv(blanks=3, max_invalid=2)
    prompt, _ = env.reset(row_index=5)
    assert prompt.split("\n", 1)[1].count(".") == 3
    blanks = [(r, c) for r in range(4) for c in range(4) if env.board[r][c] == 0]
    solution = solution_grid(random.Random("0:train:5"))
    r0, c0 = blanks[0]
    wrong = next(v for v in range(1, 5) if v != solution[r0][c0])
    obs, rew, done, _, info = env.step(f"{r0 + 1} {c0 + 1} {wrong}")
    assert rew == -0.1 and not info["valid"] and not done
    filled = [(r, c) for r in range(4) for c in range(4) if env.board[r][c]]
    obs, rew, done, _, info = env.step(f"{filled[0][0] + 1} {filled[0][1] + 1} 1")  # occupied cell
    assert not info["valid"] and done and "Game over" in obs
    env.reset(row_index=5)
    for r, c in blanks:
        obs, rew, done, _, info = env.step(f"move: {r + 1},{c + 1} = {solution[r][c]}")
        assert info["valid"]
    assert done and info["solved"] and rew == pytest.approx(1.1) and obs == "Solved!"


def test_tool_calc_calls_and_answers():
    assert safe_eval("(3 + 4) * 5 - 2") == 33
    with pytest.raises(ValueError):
        safe_eval("__import__('os')")
    env = ToolCalcEnv(max_calls=2)
    prompt, _ = env.reset(row_index=1)
    expr = prompt.split("What is ")[1].split("?")[0]
    obs, r, done, _, info = env.step(f"CALC({expr})")
    assert obs == f"RESULT: {safe_eval(expr)}" and not done and info["calls"] == 1
    obs, r, done, _, _ = env.step("CALC(2 ** 10)")
    assert obs.startswith("RESULT: error") and not done
    obs, r, done, _, info = env.step(f"ANSWER: {safe_eval(expr)}")
    assert done and r == 1.0 and info["correct"] and info["calls"] == 2
    env.reset(row_index=1)
    assert env.step("ANSWER: 0")[1] == 0.0


def test_math_env_reads_files_and_verifies_equivalent_answers(tmp_path):
    env = MathEnv()
    assert env.num_rows(False) == 30 and env.num_rows(True) == 10
    assert verify("so x = \\boxed{\\frac{1}{2}}", "\\frac{1}{2}")
    assert verify("\\boxed{0.5}", "\\frac{1}{2}")
    assert verify("\\boxed{2/4}", "\\frac{1}{2}")
    assert not verify("\\boxed{3}", "\\frac{1}{2}")
    path = tmp_path / "p.jsonl"
    path.write_text('{"q": "1+1?", "a": "2"}\n{"q": "2+2?", "a": "4"}\n')
    env = MathEnv(path=str(path), question_key="q", answer_key="a", eval_fraction=0.5, instruction="")
    assert env.reset(row_index=0)[0] == "1+1?" and env.step("it is 2")[1] == 1.0
    assert read_rows(path)[1]["a"] == "4"
    with pytest.raises(KeyError, match=r"no column\(s\) \[.question., .answer.\]"):
        MathEnv(path=str(path))
    with pytest.raises(FileNotFoundError, match=r"env\.kwargs\.path"):
        MathEnv(path=str(tmp_path / "missing.jsonl"))


def test_malformed_jsonl_line_names_file_and_line(tmp_path):
    from rlhf_lightning.config.errors import ConfigError

    path = tmp_path / "p.jsonl"
    # U+2028 inside a JSON string is valid JSON and must not split the line
    path.write_text(
        '{"question": "1+1?", "answer": "2"}\n\n{"question": "a\u2028b", "answer": "4"}\n{"q": 1,}\n'
    )
    with pytest.raises(ConfigError) as err:
        MathEnv(path=str(path))
    assert f"env.kwargs.path={str(path)!r}: line 4 is not valid JSON" in str(err.value)
    assert "Expecting property name" in str(err.value)
    path.write_text('{"question": "1+1?", "answer": "2"}\n["not", "an object"]\n')
    with pytest.raises(ConfigError, match=r"line 2 is \[\"not\", \"an object\"\], not a JSON object"):
        MathEnv(path=str(path))
    path.write_text('{"question": "1+1?", "answer": "2"}\n{"question": "a\u2028b", "answer": "4"}\n')
    assert [row["answer"] for row in read_rows(path)] == ["2", "4"]


@pytest.mark.parametrize("name, text", [("empty.jsonl", ""), ("blank.jsonl", "\n\n"), ("empty.json", "[]")])
def test_a_file_without_rows_is_refused_with_its_field(tmp_path, name, text):
    from rlhf_lightning.config.errors import ConfigError

    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"algo\.data_path.*holds no rows"):
        read_rows(path, "algo.data_path")


def test_tool_calc_long_deep_and_huge_inputs_are_answered_not_crashed():
    assert safe_eval(" + ".join(["7"] * 1000)) == 7000  # no recursion: any length evaluates
    assert safe_eval("(" * 3000 + "2" + ")" * 3000 + " * -3") == -6
    for expr, error in [
        ("1+" * 6000 + "1", "longer than 10000 characters"),
        ("999999999" + " * 999999999" * 20, "result too large"),
        ("1" * 4301, "numbers must be below 10**9"),
        ("2 ** 3", "unexpected '*'"),
    ]:
        with pytest.raises(CalcError, match=re.escape(error)):
            safe_eval(expr)
    env = ToolCalcEnv(max_calls=5)
    env.reset(row_index=0)
    obs, _, done, _, _ = env.step(f"CALC({'1 + ' * 6000}1)")
    assert obs.startswith("RESULT: error: expression longer than") and not done
    obs, r, done, _, info = env.step("ANSWER: " + "9" * 4301)  # past int()'s 4300-digit limit
    assert done and r == 0.0 and not info["correct"]
    for reply in ("CALC(" * 10_000, "ANSWER" + " " * 50_000 + "x"):  # quadratic regexes took seconds
        env.reset(row_index=0)
        start = time.perf_counter()
        obs, r, done, _, _ = env.step(reply)
        assert time.perf_counter() - start < 1.0
        assert (obs, r, done) == ("", 0.0, True)
