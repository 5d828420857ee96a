"""Traced episodes as one self-contained HTML page: a block per episode, a fold per turn.

Every text from a record goes through :func:`html.escape` (a reply holding ``<script>`` shows
as text); the page needs no script, stylesheet or font from elsewhere.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from html import escape
from typing import Any

from rlhf_lightning.traces.text import episode_sections, episode_title, turn_sections, turn_title

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; background: #fafafa; color: #222; }
section.episode { background: #fff; border: 1px solid #ccc; border-radius: 6px; margin: 1.2em 0; padding: 0.6em 1em; }
section.episode h2 { font-size: 1.05em; margin: 0.3em 0; }
details.turn { border-top: 1px solid #eee; padding: 0.3em 0; }
details.turn summary { cursor: pointer; font-weight: 600; }
.label { color: #666; font-size: 0.85em; margin: 0.4em 0 0.1em; }
pre { white-space: pre-wrap; word-break: break-word; background: #f4f4f4; padding: 0.4em; margin: 0; }
pre.reply { background: #eef6ee; }
pre.observation { background: #eef0f8; }
.negative { color: #a00; } .positive { color: #070; }
"""


def block(label: str, text: str) -> str:
    kind = label.replace(" ", "-")
    return f'<div class="label">{escape(label)}</div>\n<pre class="{escape(kind)}">{escape(text)}</pre>'


def reward_class(value: Any) -> str:
    if not isinstance(value, int | float) or value == 0:
        return ""
    return "positive" if value > 0 else "negative"


def episode_html(record: Mapping[str, Any]) -> str:
    """One ``<section>``: the episode's header and fields, then each turn in a ``<details>``."""
    out = [
        '<section class="episode">',
        f'<h2 class="{reward_class(record.get("return"))}">{escape(episode_title(record))}</h2>',
    ]
    out += [block(label, text) for label, text in episode_sections(record)]
    for turn in record.get("turns", []):
        # The last turn open: where the episode ended is what a reader looks for first.
        opened = " open" if turn is record["turns"][-1] else ""
        out.append(f'<details class="turn"{opened}>')
        out.append(
            f'<summary class="{reward_class(turn.get("reward"))}">{escape(turn_title(turn))}</summary>'
        )
        out += [block(label, text) for label, text in turn_sections(turn)]
        out.append("</details>")
    out.append("</section>")
    return "\n".join(out)


def render_html(records: Sequence[Mapping[str, Any]], title: str) -> str:
    """The page: ``title``, a count, and one block per record."""
    head = (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{escape(title)}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n"
        f"<h1>{escape(title)}</h1>\n<p>{len(records)} episodes</p>\n"
    )
    return head + "\n".join(episode_html(r) for r in records) + "\n</body>\n</html>\n"
