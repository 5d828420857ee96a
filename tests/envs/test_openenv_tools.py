"""env=openenv with env.kwargs.tools=true: an OpenEnv MCPEnvironment's tools (tests/envs/
openenv_tools, served once for the module) reach the chat template, calls run in the episode's
own session and answer with tool messages, token-exact at the tool boundaries; the call limit;
an env without MCP tools is refused naming the field."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("openenv.core", reason="the openenv extra is not installed: pip install -e '.[openenv]'")

from examples.openenv_guess.server import HIGH
from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.envs.factory import env_factory
from rlhf_lightning.envs.tool_parsers import ToolCall, parse_hermes
from tests.envs.test_tools import play, rerender
from tests.envs.tool_helpers import call, tools_tokenizer

TARGET = "rlhf_lightning.envs.openenv.OpenEnvEnv"
CLIENT = "examples.openenv_guess.client:GuessEnv"
COMPARE = {
    "type": "function",
    "function": {
        "name": "compare",
        "description": "Compare a number with the secret.",
        "parameters": {
            "type": "object",
            "additionalProperties": False,
            "properties": {"n": {"type": "integer", "description": "the number to compare"}},
            "required": ["n"],
        },
    },
}


@pytest.fixture(scope="module")
def tool_guess(tmp_path_factory):
    kwargs = {"client": CLIENT, "app": "tests.envs.openenv_tools:app", "tools": True, "max_tool_calls": 3}
    factory = env_factory(TARGET, {**kwargs, "run_dir": str(tmp_path_factory.mktemp("run"))})
    yield factory
    factory.close()


def secret(seed: int) -> int:
    return random.Random(seed).randint(1, HIGH)


def verdict(n: int, s: int) -> str:
    return "higher" if n < s else "lower" if n > s else "equal"


def test_the_tools_are_the_servers_as_function_schemas(tool_guess):
    env = tool_guess()
    assert env.tool_schemas() == [COMPARE]
    env.tool_schemas()[0]["function"]["name"] = "changed"  # a copy each time
    assert env.tool_schemas() == [COMPARE]


def test_calls_run_in_the_episodes_session_then_the_answer_is_the_envs_action(tool_guess):
    env = tool_guess()
    env.reset(row_index=7)
    s = secret(7)
    messages, reward, done, truncated, info = env.step(
        f"Let me see. {call('compare', n=8)}{call('compare', n=s)}"
    )
    assert messages == [
        {"role": "tool", "name": "compare", "content": verdict(8, s)},
        {"role": "tool", "name": "compare", "content": "equal"},
    ]
    assert (reward, done, truncated) == (0.0, False, False) and info["tool_calls"] == 2
    _, reward, done, _, info = env.step(f"It is {s}.")
    assert (reward, done, info["answered"], info["solved"]) == (1.0, True, True, True)


def test_the_call_limit_refuses_more_calls_then_ends_the_episode(tool_guess):
    env = tool_guess()
    env.reset(row_index=2)
    messages, *_, info = env.step("".join(call("compare", n=n) for n in (1, 2, 3, 4)))
    assert [m["content"].startswith("error: not run: the limit of 3") for m in messages] == [False] * 3 + [
        True
    ]
    assert info["tool_calls"] == 3 and info["tool_errors"] == 1
    out = env.step(call("compare", n=5))
    assert out[1:4] == (0.0, True, False) and out[4]["answered"] is False


def test_unknown_tools_and_malformed_calls_answer_as_tool_errors(tool_guess):
    env = tool_guess()
    env.reset(row_index=3)
    messages, reward, done, _, info = env.step(call("nothing", n=1) + "<tool_call>{not json</tool_call>")
    assert not done and reward == 0.0 and info["tool_errors"] == 2
    assert messages[0]["content"].startswith("error: ") and "nothing" in messages[0]["content"]
    assert messages[1]["content"].startswith("error: malformed tool call")


def test_a_call_then_the_answer_is_token_exact_through_the_harness(tool_guess):
    """The conversation the harness assembled is the template's rendering of the whole
    conversation, tool messages and tools included, token for token."""
    tok = tools_tokenizer()
    s = secret(0)
    first, answer = call("compare", n=5), str(s)
    traj = play(tok, tool_guess, [first, answer])
    assert parse_hermes(traj.replies[0]).calls == [ToolCall("compare", {"n": 5})]
    assert traj.observations == [[{"role": "tool", "name": "compare", "content": verdict(5, s)}]]
    assert traj.rewards == [0.0, 1.0] and not traj.truncated
    newline = tok("\n", add_special_tokens=False).input_ids
    assert rerender(tok, traj, [COMPARE]) == traj.token_ids + newline


def test_an_env_without_mcp_tools_is_refused_naming_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"env\.kwargs\.tools=True.*an env that serves MCP tools"):
        env_factory(
            TARGET,
            {
                "client": CLIENT,
                "app": "examples.openenv_guess.server:app",
                "tools": True,
                "run_dir": str(tmp_path),
            },
        )
