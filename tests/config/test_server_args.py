"""``--logprobs-mode`` in ``rollout.server_args`` is read by one helper, for the early check
(config/early.py) and the server command line (rollout/servers/process.py) alike."""

from __future__ import annotations

from rlhf_lightning.config.server_args import PROCESSED_LOGPROBS, logprobs_modes


def test_both_spellings_are_read_and_a_trailing_flag_has_no_value():
    assert PROCESSED_LOGPROBS == "processed_logprobs"
    assert logprobs_modes([]) == []
    assert logprobs_modes(["--seed", "3", "--logprobs-mode", "raw_logprobs"]) == ["raw_logprobs"]
    assert logprobs_modes(["--logprobs-mode=raw_logits", "--logprobs-mode", "processed_logprobs"]) == [
        "processed_logprobs",
        "raw_logits",
    ]
    assert logprobs_modes(["--enforce-eager", "--logprobs-mode"]) == []  # nothing after it
    assert logprobs_modes([1, "--logprobs-mode", 2]) == ["2"]  # YAML numbers read as strings
