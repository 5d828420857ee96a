"""An OpenEnv env's MCP tools through the chat template (``env.kwargs.tools=true``).

An env built on OpenEnv's ``MCPEnvironment`` serves its tools over MCP (JSON-RPC ``tools/list``
and ``tools/call``, sent in the episode's own WebSocket session, so a tool sees that episode's
game). Their schemas reach the chat template (``apply_chat_template(tools=...)``) as OpenAI
function schemas; a reply is read by the named parser (``env.kwargs.parser``, as ``env=tools``'s);
a reply with calls runs each call and answers with ``{"role": "tool", ...}`` messages (reward 0,
the episode goes on); a reply without calls is the env's own text action (its reward and done).
At most ``env.kwargs.max_tool_calls`` calls run per episode; the call after them is refused with a
tool message, and a reply with calls after that ends the episode unanswered (reward 0).
"""

from __future__ import annotations

import itertools
from typing import Any

from rlhf_lightning.config.errors import ConfigError

_IDS = itertools.count(1)


def request(method: str, params: dict[str, Any]) -> dict[str, Any]:
    """The WebSocket message carrying one MCP JSON-RPC request."""
    return {"type": "mcp", "data": {"jsonrpc": "2.0", "method": method, "params": params, "id": next(_IDS)}}


def rpc_result(response: dict[str, Any], method: str) -> dict[str, Any]:
    """The JSON-RPC result of a ``{"type": "mcp"}`` answer; a RuntimeError with the server's
    message for a JSON-RPC error."""
    data = response.get("data") or {}
    if data.get("error"):
        err = data["error"]
        raise RuntimeError(f"MCP {method} answered error {err.get('code')}: {err.get('message')}")
    result = data.get("result")
    if not isinstance(result, dict):
        raise RuntimeError(f"MCP {method} answered no result: {str(response)[:300]}")
    return result


def function_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """An MCP tool (``name``, ``description``, ``input_schema`` / ``inputSchema``) as the
    function schema chat templates render (``{"type": "function", "function": {...}}``)."""
    parameters = tool.get("input_schema") or tool.get("inputSchema") or {"type": "object", "properties": {}}
    return {
        "type": "function",
        "function": {
            "name": str(tool["name"]),
            "description": str(tool.get("description") or ""),
            "parameters": parameters,
        },
    }


async def list_tools(client: Any) -> list[dict[str, Any]]:
    """The session's MCP tools as function schemas."""
    result = rpc_result(await client._send_and_receive(request("tools/list", {})), "tools/list")
    return [function_schema(t) for t in result.get("tools") or []]


async def call_tool(client: Any, name: str, arguments: dict[str, Any]) -> tuple[str, bool]:
    """Run one tool in the session: (its text, whether it failed). A JSON-RPC error (an unknown
    tool, bad arguments) is the tool's answer, not a failure of the env."""
    response = await client._send_and_receive(request("tools/call", {"name": name, "arguments": arguments}))
    try:
        result = rpc_result(response, "tools/call")
    except RuntimeError as err:
        return f"error: {err}", True
    texts = [str(c.get("text", "")) for c in result.get("content") or [] if isinstance(c, dict)]
    failed = bool(result.get("is_error") or result.get("isError"))
    return ("\n".join(texts) if texts else str(result.get("data", ""))), failed


def no_tools_error(client_path: str, why: str) -> ConfigError:
    return ConfigError(
        "env.kwargs.tools",
        True,
        f"an env that serves MCP tools (an OpenEnv MCPEnvironment): {client_path}'s server {why}; "
        "set env.kwargs.tools=false for a text-only env",
    )
