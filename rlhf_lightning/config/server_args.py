"""What the run reads from ``rollout.server_args`` (the extra arguments of the vLLM servers it
starts). Import-light (no omegaconf, torch or vLLM): the early config checks
(``config/early.py``) and the server command line (``rollout/servers/process.py``) share it.
"""

from __future__ import annotations

from collections.abc import Iterable

# The log-probs the ratio needs (after temperature and the top-k/top-p/min-p filters): the
# servers are started with ``--logprobs-mode processed_logprobs``, and no other mode is accepted.
PROCESSED_LOGPROBS = "processed_logprobs"


def logprobs_modes(args: Iterable[object]) -> list[str]:
    """Every ``--logprobs-mode`` value in ``args``: the argument after ``--logprobs-mode`` (none
    when it comes last), then each ``--logprobs-mode=<mode>``'s ``<mode>``."""
    words = [str(a) for a in args]
    modes = [words[i + 1] for i, a in enumerate(words[:-1]) if a == "--logprobs-mode"]
    return modes + [a.split("=", 1)[1] for a in words if a.startswith("--logprobs-mode=")]
