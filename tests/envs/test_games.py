"""Each env's rules, scored by hand."""

from __future__ import annotations

import random

import pytest

from rlhf_lightning.data.files import read_rows
from rlhf_lightning.envs.base import TextEnv
from rlhf_lightning.envs.guess_number import GuessNumberEnv
from rlhf_lightning.envs.math import MathEnv, verify
from rlhf_lightning.envs.sudoku import SudokuEnv, is_valid_grid, solution_grid
from rlhf_lightning.envs.tool_calc import ToolCalcEnv, safe_eval


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
