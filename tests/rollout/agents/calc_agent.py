"""Agents written with the official ``openai`` client, as a user would write them, for the tests
of ``env=agent``: a calculator agent (two turns and one tool call), and ones that hang, crash,
never call the model, or drop their history."""

from __future__ import annotations

import asyncio
import json
import re

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 3 + 4 * 2"}},
            "required": ["expression"],
        },
    },
}


def calculate(expression: str) -> str:
    if not re.fullmatch(r"[\d\s+\-*/()]+", expression):
        return "error: only numbers and + - * / ( )"
    try:
        return str(int(eval(expression)))  # a checked arithmetic expression only
    except Exception as err:
        return f"error: {err}"


async def solve(client, task):
    """Ask the question with the calculator; run the calls it makes; one more turn with the
    results; reward 1 when the last reply holds the answer."""
    messages = [{"role": "user", "content": task["question"]}]
    reply = await client.chat.completions.create(
        model="policy", messages=messages, tools=[CALCULATOR], max_tokens=48
    )
    message = reply.choices[0].message
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls or []:
        args = json.loads(call.function.arguments)
        result = calculate(str(args.get("expression", "")))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    if not message.tool_calls:
        messages.append({"role": "user", "content": "Use the calculator."})
    final = await client.chat.completions.create(
        model="policy", messages=messages, tools=[CALCULATOR], max_tokens=48
    )
    text = final.choices[0].message.content or ""
    correct = str(task["gold"]) in re.findall(r"-?\d+", text)
    return {"reward": float(correct), "correct": correct, "tool_calls": len(message.tool_calls or [])}


async def solve_streaming(client, task):
    """Two turns asked as server-sent events (as verifiers asks), without tools."""
    messages = [{"role": "user", "content": task["question"]}]
    for _ in range(2):
        stream = await client.chat.completions.create(
            model="any", messages=messages, max_tokens=16, stream=True
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Again."}]
    return 1.0


async def forgetful(client, task):
    """Each call sends only the question and the last reply as a fresh user message: never an
    extension of the call before it."""
    text = ""
    for _ in range(2):
        content = task["question"] + (f"\nYou said: {text}" if text else "")
        reply = await client.chat.completions.create(
            model="p", messages=[{"role": "user", "content": content}], max_tokens=12
        )
        text = reply.choices[0].message.content or ""
    return 0.5


async def hangs(client, task):
    await client.chat.completions.create(
        model="p", messages=[{"role": "user", "content": task["question"]}], max_tokens=4
    )
    await asyncio.sleep(3600)
    return 1.0


async def crashes(client, task):
    await client.chat.completions.create(
        model="p", messages=[{"role": "user", "content": task["question"]}], max_tokens=4
    )
    raise RuntimeError("the agent's own bug")


async def silent(client, task):
    return 1.0


def not_async(client, task):
    return 1.0
