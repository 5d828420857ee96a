"""Writes examples/agent_calc/tasks.jsonl: the first 2000 distinct problems of env=tool_calc
(seed 0), one row each (question, answer). Run from the repository root."""

import json

from rlhf_lightning.envs.tool_tasks import calc_problem

seen: set[str] = set()
with open("examples/agent_calc/tasks.jsonl", "w") as f:
    row = 0
    while len(seen) < 2000:
        expr, answer = calc_problem(0, row, False)
        row += 1
        if expr not in seen:
            seen.add(expr)
            f.write(json.dumps({"question": expr, "answer": str(answer)}) + "\n")
