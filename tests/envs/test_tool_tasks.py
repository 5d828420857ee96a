"""The tool tasks: the calculator tool and its task, and ``env=tools`` composed, validated and
trained."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from transformers.utils import get_json_schema

from rlhf_lightning.envs.tool_calc import ToolCalcEnv
from rlhf_lightning.envs.tool_tasks import CalculatorToolEnv, calculator
from rlhf_lightning.records.sampling import Completion
from rlhf_lightning.rollout.engines.base import EngineBase
from tests.envs.tool_helpers import TEMPLATE, call

# -- the calculator task ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("(12 + 3) * 4", "60"),
        ("2 + 3 * 4 - 6 / 3", "12"),
        ("7 / 2", "3.5"),
        ("1 / 3", "0.333333333333"),
        ("2 - -3", "5"),
        ("-(4) * 2", "-8"),
        ("10 / 4 * 2", "5"),
        ("8 / 2 / 2", "2"),
        ("(" * 3000 + "1" + ")" * 3000, "1"),
    ],
)
def test_calculator_values(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize(
    ("expression", "error"),
    [
        ("1 / 0", "division by zero"),
        ("2 ** 3", "unexpected '*'"),
        ("__import__('os')", "unexpected '_'"),
        ("1.5 + 1", "unexpected '.'"),
        ("(1 + 2", "unbalanced '('"),
        ("1 + 2)", "unbalanced ')'"),
        ("1 +", "incomplete expression"),
        ("1" * 10, "numbers must be below 10**9"),
        ("1+" * 6000 + "1", "expression longer than 10000 characters"),
    ],
)
def test_calculator_refuses(expression, error):
    with pytest.raises(ValueError, match=f"^{re.escape(error)}$"):
        calculator(expression)


def test_calculator_env_uses_tool_calc_rows_and_scores_answers():
    env = CalculatorToolEnv(seed=3)
    for row, evaluation in ((0, False), (5, False), (1, True)):
        prompt, _ = env.reset(row_index=row, evaluation=evaluation)
        old = ToolCalcEnv(seed=3)
        old_prompt, _ = old.reset(row_index=row, evaluation=evaluation)
        expr = old_prompt.removeprefix("What is ").split("?")[0]
        a, times, b, op, c = expr.split(" ")  # "a * b + c" or "a * b - c"
        assert times == "*" and op in "+-"
        expected = int(a) * int(b) + (int(c) if op == "+" else -int(c))
        assert prompt.startswith(f"What is {expr}?") and env.answer == expected == old.answer
        obs, *_ = env.step(call("calculator", expression=expr))
        assert obs == [{"role": "tool", "name": "calculator", "content": str(expected)}]
        assert env.step(f"The answer is {expected}.")[1:3] == (1.0, True)
        env.reset(row_index=row, evaluation=evaluation)
        assert env.step(str(expected + 1))[1] == 0.0
    obs, *_ = env.step(call("calculator", expression="1/0"))
    assert obs[0]["content"] == "error: calculator raised CalcError: division by zero"
    assert [s["function"]["name"] for s in env.tool_schemas()] == ["calculator"]
    assert env.num_rows(False) == 100_000 and env.num_rows(True) == 200


# -- env=tools ------------------------------------------------------------------------------------


def test_env_tools_composes_and_validates(fast_cfg):
    from omegaconf import OmegaConf

    from rlhf_lightning.envs.factory import env_factory
    from rlhf_lightning.run.validation import validate

    cfg = fast_cfg("env=tools", "model=tiny_chat", "rollout.tool_parser=pythonic")
    validate(cfg)
    e = cfg.env
    # steps on threads; each tool call in a worker process with its own limit
    assert (e.max_turns, e.concurrency, e.step_timeout_s, e.step_workers) == (4, 8, None, "thread")
    kwargs = OmegaConf.to_container(e.kwargs, resolve=True)
    assert kwargs["parser"] == "pythonic" and (kwargs["tool_timeout_s"], kwargs["tool_workers"]) == (5.0, 8)
    env = env_factory(e._target_, kwargs)()
    assert isinstance(env, CalculatorToolEnv) and env.tool_schemas() == [get_json_schema(calculator)]
    path = compose_path(fast_cfg)
    assert Path(path) == TEMPLATE and TEMPLATE.is_file()


def compose_path(fast_cfg) -> str:
    """model.chat_template as the yaml's comment tells users to set it."""
    return fast_cfg(
        "env=tools", "model=tiny_chat", "model.chat_template=${asset:chat_templates/tools.jinja}"
    ).model.chat_template


class CalculatorPlayer(EngineBase):
    """Plays env=tools for the tiny chat model (which never calls a tool): turn 1 calls the
    calculator on the question's expression, turn 2 answers with its result (every other
    episode off by one, so the rewards of a group differ and the step has a gradient)."""

    def __init__(self, tokenizer) -> None:
        self.tok, self.turn_calls = tokenizer, 0

    def generate(self, prompt_token_ids, params):
        out = []
        for i, ids in enumerate(prompt_token_ids):
            text = self.tok.decode(ids)
            results = re.findall(r"<tool_response>\n(-?\d+)\n", text)
            if not results:
                reply = call("calculator", expression=re.findall(r"What is (.+?)\?", text)[-1])
            else:
                reply = str(int(results[-1]) + i % 2)
            reply_ids = self.tok(reply, add_special_tokens=False).input_ids + [self.tok.eos_token_id]
            out.append(Completion(reply_ids, [-1.0] * len(reply_ids), "stop", i))
        self.turn_calls += 1
        return out


@pytest.mark.slow
def test_env_tools_trains_two_steps_on_tiny_chat(fast_cfg, tmp_path):
    import lightning as L
    import torch

    from tests.conftest import fit_steps

    class Metrics(L.Callback):
        def __init__(self) -> None:
            self.steps: list[dict[str, float]] = []

        def on_train_batch_end(self, trainer, *args):
            self.steps.append({k: float(v) for k, v in trainer.callback_metrics.items()})

    cfg = fast_cfg("env=tools", "model=tiny_chat", "rollout.max_new_tokens=96", "algo.group_size=2")
    # load_tokenizer takes a template string; a .jinja path needs the change to models/build.py
    # described in the report, so the test sets the template's text.
    cfg.model.chat_template = TEMPLATE.read_text()
    before: dict[str, torch.Tensor] = {}

    def hook(module):
        module.engine = module.source.engine = CalculatorPlayer(module.harness.tokenizer)
        before.update({n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad})

    metrics = Metrics()
    module, trainer = fit_steps(cfg, tmp_path, steps=2, callbacks=[metrics], module_hook=hook)
    assert trainer.global_step == 2
    assert module.harness.formatter.tools == [get_json_schema(calculator)]
    for step in metrics.steps:
        assert step["rollout/num_turns"] == 2.0 and step["env/reward_errors"] == 0.0
        assert step["env/tool_calls"] == 0.5  # one call in the first of two turns
        assert step["env/correct"] == 0.25 and step["rollout/reward_mean"] == 0.5
    moved = [n for n, p in module.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert moved, "no trainable parameter changed"
