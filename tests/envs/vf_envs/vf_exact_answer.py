"""A verifiers 0.4.0 environment written for the tests of ``env=verifiers``: single-turn
arithmetic from a local JSONL file (``path``; ``question``/``answer`` columns), reward 1 when the
reply, stripped, is exactly the answer. Importable as the top-level module ``vf_exact_answer``
(the tests put this folder on ``sys.path``, as an installed environment package would be)."""

from __future__ import annotations

import json
from pathlib import Path

import verifiers.v1 as vf


class ExactAnswerConfig(vf.TasksetConfig):
    path: str
    limit: int | None = None
    fail_on: str | None = None  # a question whose scoring raises (a rollout verifiers fails)


class ExactAnswerData(vf.TaskData):
    answer: str


class ExactAnswerTask(vf.Task[ExactAnswerData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def exact(self, task: ExactAnswerData, trace: vf.Trace) -> float:
        if task.prompt == FAIL_MARK:
            raise ValueError("the scorer of this test env refuses this task")
        return float(trace.last_reply == task.answer)

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


FAIL_MARK = "FAIL THIS ROLLOUT"


class ExactAnswerTaskset(vf.Taskset[ExactAnswerTask, ExactAnswerConfig]):
    def load(self):
        with Path(self.config.path).open() as f:
            rows = [json.loads(line) for line in f if line.strip()]
        for i, row in enumerate(rows[: self.config.limit]):
            prompt = FAIL_MARK if row["question"] == self.config.fail_on else row["question"]
            yield ExactAnswerTask(
                ExactAnswerData(id=str(i), prompt=prompt, answer=str(row["answer"])), self.config.task
            )


__all__ = ["ExactAnswerTaskset"]
