"""Traced episodes as plain text: the terminal view of ``python -m rlhf_lightning.traces``."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


def shown(value: Any) -> str:
    """An observation or info as text: a string as it is, chat messages one per line."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(m, Mapping) and "content" in m for m in value):
        return "\n".join(f"{m.get('role', '?')}: {m['content']}" for m in value)
    return json.dumps(value, ensure_ascii=False)


def number(value: Any) -> str:
    return "-" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)


def episode_title(record: Mapping[str, Any]) -> str:
    """``step 3 · episode 0 · group 0 · return 0.9 · 2 turns · versions [2]`` (and flags)."""
    parts = [
        f"step {record.get('step')}",
        f"episode {record.get('episode')}",
        f"group {record.get('group')}",
        f"return {number(record.get('return'))}",
        f"{record.get('num_turns', len(record.get('turns', [])))} turns",
        f"versions {record.get('versions')}",
    ]
    parts += [flag for flag in ("truncated", "cut") if record.get(flag)]
    return " · ".join(parts)


def turn_title(turn: Mapping[str, Any]) -> str:
    """``turn 0 · reward -0.1 · stop · 7 tokens · version 2`` (and ``new sequence``)."""
    parts = [
        f"turn {turn.get('turn')}",
        f"reward {number(turn.get('reward'))}",
        str(turn.get("finish_reason")),
        f"{turn.get('tokens')} tokens",
        f"version {turn.get('version')}",
    ]
    if turn.get("new_sequence") and turn.get("turn", 0) > 0:
        parts.append("new sequence")
    return " · ".join(parts)


def turn_sections(turn: Mapping[str, Any], context: bool = True) -> list[tuple[str, str]]:
    """(label, text) of a turn's parts that have something to show."""
    out = [("context", shown(turn.get("context", "")))] if context else []
    out += [("reply", shown(turn.get("reply", ""))), ("observation", shown(turn.get("observation", "")))]
    if turn.get("info"):
        out.append(("info", shown(turn["info"])))
    return [(label, text) for label, text in out if text]


def episode_sections(record: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(label, text) of the episode's own fields that have something to show."""
    out = [
        ("task", shown(record.get("task_info") or "")),
        ("reward parts", shown(record.get("reward_parts") or "")),
        ("timings", shown(record.get("timings") or "")),
    ]
    return [(label, text) for label, text in out if text]


def indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line for line in text.splitlines()) or prefix


def render_text(record: Mapping[str, Any], context: bool = True) -> str:
    """One episode, readable in a terminal (``context=False``: without each turn's context)."""
    lines = [f"=== {episode_title(record)} ==="]
    for label, text in episode_sections(record):
        lines += [f"  [{label}]", indent(text)]
    for turn in record.get("turns", []):
        lines.append(f"--- {turn_title(turn)}")
        for label, text in turn_sections(turn, context):
            lines += [f"  [{label}]", indent(text)]
    return "\n".join(lines) + "\n"
