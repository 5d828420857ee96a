"""A calculator agent written with the official ``openai`` client, as it would be written
outside any training framework: it asks the model, runs the calculator calls it makes, hands
back the results, and scores the final answer. ``env=agent`` trains the model behind it:

    python train.py experiment=agent_calc
"""

from __future__ import annotations

import json
import re

from transformers.utils import get_json_schema

from rlhf_lightning.envs.tool_tasks import calculator

TOOLS = [get_json_schema(calculator)]
MAX_CALLS = 4


async def solve(client, task):
    """One episode: up to ``MAX_CALLS`` model calls; reward 1 when the final reply's last number
    is the answer."""
    messages = [
        {
            "role": "user",
            "content": f"What is {task['question']}? Use the calculator tool if it helps, then reply with the number.",
        }
    ]
    calls = 0
    for _ in range(MAX_CALLS):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        if not message.tool_calls:  # the final answer
            numbers = re.findall(r"-?\d+", message.content or "")
            correct = bool(numbers) and int(numbers[-1]) == int(task["gold"])
            return {"reward": float(correct), "correct": correct, "calls": calls}
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            calls += 1
            try:
                result = calculator(**json.loads(call.function.arguments))
            except Exception as err:  # a bad call: the model reads the error
                result = f"error: {err}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return {"reward": 0.0, "correct": False, "calls": calls}
