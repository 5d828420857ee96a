"""Helpers shared by the ToolEnv tests: the tools chat template, the tokenizer with it, and
tool calls in Hermes format."""

from __future__ import annotations

import json

from rlhf_lightning.config import ASSETS
from rlhf_lightning.models.build import load_tokenizer

TEMPLATE = ASSETS / "chat_templates" / "tools.jinja"


def tools_tokenizer():
    """The embedded chat model's tokenizer with the tools template."""
    return load_tokenizer(str(ASSETS / "tiny_chat"), chat_template=TEMPLATE.read_text())


def call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"
