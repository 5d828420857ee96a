"""A verifiers 0.4.0 environment written for the tests of ``env=verifiers``: multi-turn, the
model may call one tool (``calculator``, an MCP tool server shared by the taskset's rollouts)
before answering; reward 1 when the last reply holds the answer. Importable as the top-level
module ``vf_calc_tool``; ``python -m vf_calc_tool`` serves the tool (how verifiers starts it)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import verifiers.v1 as vf


class CalcConfig(vf.TasksetConfig):
    path: str
    limit: int | None = None
    fail_on: str | None = None  # a question whose scoring raises (a rollout verifiers fails)


class CalcData(vf.TaskData):
    answer: str


class CalcTask(vf.Task[CalcData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, task: CalcData, trace: vf.Trace) -> float:
        if task.prompt == FAIL_MARK:
            raise ValueError("the scorer of this test env refuses this task")
        return float(task.answer in re.findall(r"-?\d+", trace.last_reply))

    @vf.metric
    async def tool_results(self, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages))


class CalculatorConfig(vf.SharedToolsetConfig):
    pass


class Calculator(vf.Toolset[CalculatorConfig, vf.State]):
    TOOL_PREFIX = None  # the tool is `calculator`, not `calculator_calculator`

    @vf.tool(name="calculator")
    async def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression exactly."""
        if not re.fullmatch(r"[\d\s+\-*/()]+", expression):
            return "error: only numbers and + - * / ( )"
        try:
            return str(int(eval(expression)))  # a checked arithmetic expression only
        except Exception as err:
            return f"error: {err}"


FAIL_MARK = "FAIL THIS ROLLOUT"
PROMPT = "What is {}? Use the calculator tool if it helps, then reply with the number."


class CalcTaskset(vf.Taskset[CalcTask, CalcConfig]):
    def load(self):
        with Path(self.config.path).open() as f:
            rows = [json.loads(line) for line in f if line.strip()]
        for i, row in enumerate(rows[: self.config.limit]):
            prompt = FAIL_MARK if row["question"] == self.config.fail_on else PROMPT.format(row["question"])
            yield CalcTask(CalcData(id=str(i), prompt=prompt, answer=str(row["answer"])), self.config.task)

    @classmethod
    def toolsets(cls, config: CalcConfig) -> list[vf.Toolset]:
        return [Calculator(CalculatorConfig())]


__all__ = ["CalcTaskset"]

if __name__ == "__main__":
    Calculator.run()
