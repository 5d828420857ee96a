"""The tools chat template: plain chats rendered like tiny_chat's, tools listed in the system
turn, tool calls rendered as Hermes text, prefix-stable tool turns."""

from __future__ import annotations

import json

import pytest
from transformers.utils import get_json_schema

from rlhf_lightning.config import ASSETS
from rlhf_lightning.envs.tool_parsers import ToolCall, parse_hermes
from rlhf_lightning.envs.tool_tasks import add
from rlhf_lightning.rollout.episodes.chat import ChatFormatter
from tests.envs.tool_helpers import TEMPLATE, tools_tokenizer


@pytest.fixture(scope="module")
def tok():
    """The embedded chat model's tokenizer with the tools template."""
    return tools_tokenizer()


PLAIN = [
    [{"role": "user", "content": "What is 2 + 3?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Guess a number."},
        {"role": "assistant", "content": "10"},
        {"role": "user", "content": "higher"},
        {"role": "assistant", "content": "15"},
    ],
]


@pytest.mark.parametrize("messages", PLAIN)
@pytest.mark.parametrize("generation_prompt", [False, True])
def test_template_renders_plain_chats_like_tiny_chat(tok, messages, generation_prompt):
    tiny = (ASSETS / "tiny_chat" / "chat_template.jinja").read_text()
    expected = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    expected += "<|im_start|>assistant\n" if generation_prompt else ""
    for template in (tiny, TEMPLATE.read_text()):
        text = tok.apply_chat_template(
            messages, chat_template=template, add_generation_prompt=generation_prompt, tokenize=False
        )
        assert text == expected


def test_template_lists_tools_in_the_system_turn(tok):
    schemas = [get_json_schema(add)]
    for system, prefix in ((None, ""), ("Be brief.", "Be brief.\n\n")):
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": "Q"}
        ]
        text = tok.apply_chat_template(messages, tools=schemas, tokenize=False, add_generation_prompt=True)
        head = f"<|im_start|>system\n{prefix}You can call these functions; their JSON schemas:\n<tools>\n"
        assert text.startswith(head + json.dumps(schemas[0]) + "\n</tools>\n")
        assert text.count("<|im_start|>system") == 1
        assert text.endswith("<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n")


def test_template_renders_tool_calls_as_hermes_text(tok):
    messages = [
        {"role": "user", "content": "Q"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}},
                {"type": "function", "function": {"name": "lookup", "arguments": '{"key": "fig"}'}},
            ],
        },
        {"role": "tool", "name": "add", "content": "3"},
        {"role": "tool", "name": "lookup", "content": "5"},
    ]
    text = tok.apply_chat_template(messages, tools=[get_json_schema(add)], tokenize=False)
    turn = (
        '<|im_start|>assistant\nChecking.\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n'
        '<tool_call>{"name": "lookup", "arguments": {"key": "fig"}}</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
    )
    assert text.endswith(turn)
    assistant = text[text.index("<|im_start|>assistant\n") :]
    assert parse_hermes(assistant).calls == [
        ToolCall("add", {"a": 1, "b": 2}),
        ToolCall("lookup", {"key": "fig"}),
    ]


def test_template_is_prefix_stable_with_tools(tok):
    formatter = ChatFormatter(tok, "Be brief.", tools=[get_json_schema(add)])
    two_tools = [{"role": "tool", "content": "3"}, {"role": "tool", "content": "4"}]
    formatter.check_prefix_stable(
        [[{"role": "tool", "content": "r"}], two_tools, [{"role": "user", "content": "u"}]]
    )
