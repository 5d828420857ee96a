"""``env=verifiers``' default agent program: a chat loop that runs inside the worker's own
process, so a verifiers environment needs neither ``uv`` nor packages fetched at run time.

verifiers 0.4.0 plays each rollout with a *harness*: a program that talks to the model through
verifiers' interception server (which records the trace and relays each call to the run's
endpoint). Its own ``null`` and ``bash`` harnesses are scripts it prepares with ``uv`` (``uv sync
--script``: ``openai``, ``mcp`` ... from PyPI on first use) and starts as a subprocess per
rollout. This one does what ``null`` does, in process: the task's prompt (and system prompt) as
the first messages, the tools of the task's MCP servers offered to the model, each tool call run
on its server and its result sent back, until a reply calls no tool. Every model call is
streamed (``stream=true``), as verifiers' own programs ask.

The harness loader of verifiers imports a harness by a top-level name (a dotted path is not
accepted), so :func:`register` files this module under ``verifiers.v1.harnesses.rlhf_chat``
(:data:`HARNESS_ID`) in the process that loads the environment.
"""

from __future__ import annotations

import json
import sys
import traceback
from contextlib import AsyncExitStack
from typing import Any, cast

import openai
from verifiers.v1 import Harness, HarnessConfig, ModelContext, ProgramResult, Runtime, TaskData, Trace
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.harnesses.utils.mcp import call_mcp, connect_mcp

HARNESS_ID = "rlhf_chat"

__all__ = ["HARNESS_ID", "InProcessChatHarness", "register"]


def register() -> None:
    """Make ``harness.id=rlhf_chat`` resolve to :class:`InProcessChatHarness` in this process."""
    sys.modules.setdefault(f"verifiers.v1.harnesses.{HARNESS_ID}", sys.modules[__name__])


async def streamed_reply(
    client: openai.AsyncOpenAI, model: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> dict[str, Any]:
    """One streamed chat call, its deltas joined into the assistant message (content and tool
    calls); raises when the stream ends before a choice finished."""
    kwargs: dict[str, Any] = {"tools": tools} if tools else {}
    stream = await client.chat.completions.create(
        model=model,
        messages=messages,  # type: ignore[arg-type]
        stream=True,
        **kwargs,
    )
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    finished = False
    async for chunk in cast(Any, stream):  # stream=True: chunks (mypy cannot pick the overload)
        for choice in chunk.choices:
            delta = choice.delta
            content.append(delta.content or "")
            for tc in delta.tool_calls or []:
                call = calls.setdefault(
                    tc.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
                )
                call["id"] = tc.id or call["id"]
                if tc.function is not None:
                    call["function"]["name"] += tc.function.name or ""
                    call["function"]["arguments"] += tc.function.arguments or ""
            finished = finished or choice.finish_reason is not None
    if not finished:
        raise RuntimeError("the model's stream ended before its reply finished")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(content)}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message


class InProcessChatHarness(Harness[HarnessConfig]):
    """The chat loop of the module's docstring (verifiers' ``Harness`` interface)."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_MCP = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(  # type: ignore[override]
        self,
        ctx: ModelContext,
        trace: Trace,
        runtime: Runtime,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data: TaskData,
    ) -> ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt is not None:
            messages += [message_to_wire(m) for m in prompt]
        client = openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
        try:
            async with AsyncExitStack() as stack:
                servers = {n: {"url": u, "timeout": self.config.tool_timeout} for n, u in mcp_urls.items()}
                tools, dispatch, conns = (
                    await connect_mcp({"mcpServers": servers}, stack) if servers else ([], {}, {})
                )
                while True:
                    message = await streamed_reply(client, ctx.model, messages, tools)
                    messages.append(message)
                    if not message.get("tool_calls"):
                        break
                    for call in message["tool_calls"]:
                        name = call["function"]["name"]
                        try:
                            args = json.loads(call["function"]["arguments"] or "{}")
                        except json.JSONDecodeError as err:
                            result: Any = f"error: the arguments are not JSON ({err})"
                        else:
                            if name not in dispatch:
                                result = f"error: unknown tool {name!r}"
                            elif not isinstance(args, dict):
                                result = "error: the arguments must be a JSON object"
                            else:
                                result = await call_mcp(conns, dispatch, name, args)
                        messages.append(
                            {"role": "tool", "tool_call_id": call["id"], "name": name, "content": result}
                        )
        except Exception:  # the program's failure, as a subprocess harness reports one
            return ProgramResult(exit_code=1, stdout="", stderr=traceback.format_exc())
        finally:
            await client.close()
        return ProgramResult(exit_code=0, stdout="", stderr="")
