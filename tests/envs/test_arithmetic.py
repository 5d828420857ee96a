from __future__ import annotations

import pytest

from rlhf_lightning.envs.arithmetic import ArithmeticEnv, final_integer, make_problem
from rlhf_lightning.envs.base import TextEnv


def test_problems_are_deterministic_and_splits_disjoint():
    train = {make_problem(0, i, False, 10, 99) for i in range(3000)}
    evals = {make_problem(0, i, True, 10, 99) for i in range(300)}
    assert make_problem(0, 5, False, 10, 99) == make_problem(0, 5, False, 10, 99)
    assert make_problem(0, 5, False, 10, 99) != make_problem(1, 5, False, 10, 99)
    assert not {p.question for p in train} & {p.question for p in evals}
    assert all(p.answer >= 0 for p in train | evals)


def test_env_scores_final_integer():
    env = ArithmeticEnv()
    assert isinstance(env, TextEnv)
    question, _ = env.reset(row_index=3)
    answer = make_problem(0, 3, False, 10, 99).answer
    assert question == make_problem(0, 3, False, 10, 99).question
    obs, reward, terminated, truncated, info = env.step(f"The answer is {answer}")
    assert (obs, reward, terminated, truncated, info["correct"]) == ("", 1.0, True, False, True)
    assert env.step(f"{answer + 1}")[1] == 0.0
    exact = ArithmeticEnv(exact=True)
    exact.reset(row_index=3)
    assert exact.step(f" {answer}\n")[1] == 1.0
    assert exact.step(f"It is {answer}")[1] == 0.0


def test_final_integer_and_bad_range():
    assert final_integer("12 then 1,234") == 1234
    assert final_integer("-7") == -7
    assert final_integer("none") is None
    with pytest.raises(ValueError, match="min_operand <= max_operand"):
        ArithmeticEnv(min_operand=50, max_operand=10)


def test_reply_with_more_digits_than_int_allows_is_a_wrong_answer():
    env = ArithmeticEnv()
    env.reset(row_index=3)
    answer = make_problem(0, 3, False, 10, 99).answer
    assert env.step(f"{answer} or " + "9" * 4301)[1:4] == (0.0, True, False)  # int() refuses > 4300 digits
    assert env.step("0" * 5000 + str(answer))[1] == 1.0  # leading zeros do not count
    assert final_integer("-" + "0" * 5000 + "42") == -42
    assert final_integer("1" * 101) is None and final_integer("1" * 100) == int("1" * 100)
