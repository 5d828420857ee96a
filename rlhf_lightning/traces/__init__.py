"""Rollout traces: whole episodes of some training steps in the run's ``traces.jsonl``.

writer.py   episode records and the size-bounded, crash-safe ``traces.jsonl`` (TraceWriter)
text.py     an episode as terminal text; html.py: episodes as one self-contained HTML page
__main__.py ``python -m rlhf_lightning.traces RUN [--step N] [--html out.html]``

The callback that writes them every ``trace.every_n_steps`` is ``callbacks/traces.py``.
"""

from rlhf_lightning.traces.html import render_html
from rlhf_lightning.traces.text import render_text
from rlhf_lightning.traces.writer import FILE, TraceWriter, episode_record, read_traces

__all__ = ["FILE", "TraceWriter", "episode_record", "read_traces", "render_html", "render_text"]
