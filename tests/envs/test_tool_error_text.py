"""A tool's error text is cut to ``max_result_chars`` like its result: a tool that raises with a
huge message (or a traceback) cannot flood the model's context."""

from __future__ import annotations

import pytest

from rlhf_lightning.envs.tool_tasks import AddLookupToolEnv
from tests.envs.slow_things import shouts
from tests.envs.tool_helpers import call


@pytest.mark.parametrize("timeout_s", [None, 30.0])  # in this process, and in a worker
def test_a_tools_error_message_is_cut_to_max_result_chars(timeout_s):
    env = AddLookupToolEnv(tools=[shouts], max_result_chars=40, tool_timeout_s=timeout_s)
    env.reset(row_index=0)
    content = env.step(call("shouts", n=5000))[0][0]["content"]
    full = "error: shouts raised ValueError: " + "x" * 5000
    assert content == full[:40] + "... [cut to 40 characters]"


def test_a_malformed_calls_echo_is_cut_to_max_result_chars():
    env = AddLookupToolEnv(tools=[shouts], max_result_chars=40, tool_timeout_s=None)
    env.reset(row_index=0)
    content = env.step("<tool_call>{" + "y" * 5000 + "</tool_call>")[0][0]["content"]
    assert content.startswith("error: malformed tool call")
    assert content.endswith("... [cut to 40 characters]") and len(content) == 40 + len(
        "... [cut to 40 characters]"
    )
