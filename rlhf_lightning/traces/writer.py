"""Episode records and ``traces.jsonl``: one JSON object per traced episode, one line each.

episode_record  a :class:`Trajectory` as a plain dict: each turn's context (the token ids the
                model was given at that turn, decoded), reply, the env's observation after it,
                reward, finish reason and policy version; the episode's return and infos
TraceWriter     appends one step's records to ``traces.jsonl`` (rank 0), size-bounded
read_traces     the complete records of a file (a line a crash cut short is never one)

Crash safety: a step's lines are appended in one write, then flushed and fsynced. A crash can
leave only the file's last line unfinished (no newline): readers take complete lines only, and
the writer's first write of a process cuts such a tail off (and the records of steps it traces
again after a resume). The size bound: when an append would take the file past ``max_bytes``,
the oldest steps are dropped, the newest kept within half the bound, and the file rewritten
through a temporary file beside it (``os.replace``: never half-written).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rlhf_lightning.records.trajectory import Trajectory

log = logging.getLogger(__name__)

FILE = "traces.jsonl"


def clip_text(text: str, max_chars: int) -> str:
    """``text`` within ``max_chars`` (0: unbounded): its head and tail around a marker."""
    if max_chars <= 0 or len(text) <= max_chars:
        return text
    marker = f" …[{len(text) - max_chars} chars cut]… "
    head = max((max_chars - len(marker)) // 2, 0)
    tail = max(max_chars - len(marker) - head, 0)
    return text[:head] + marker + (text[len(text) - tail :] if tail else "")


def plain(value: Any, max_chars: int) -> Any:
    """``value`` as JSON-ready data, each string clipped to ``max_chars``; a tensor or array
    scalar becomes its number, anything else unknown its ``str``."""
    if isinstance(value, str):
        return clip_text(value, max_chars)
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, Mapping):
        return {str(k): plain(v, max_chars) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v, max_chars) for v in value]
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "ndim", None) == 0:
        return plain(item(), max_chars)
    return clip_text(str(value), max_chars)


def segment_start(starts: Sequence[int], index: int) -> int:
    """The start of the sequence (``Trajectory.segment_starts``) that holds token ``index``."""
    return max((s for s in starts if s <= index), default=0)


def turn_records(traj: Trajectory, version: int, decode: Callable[[list[int]], str]) -> list[dict[str, Any]]:
    """Each turn of ``traj``: the context it was generated from, its reply and what followed."""
    ids, starts, segments = traj.token_ids, traj.turn_starts(), traj.segment_starts
    turns: list[dict[str, Any]] = []
    for k, begin in enumerate(starts):
        first = segment_start(segments, begin)
        end = begin + (traj.turn_lengths[k] if k < len(traj.turn_lengths) else 0)
        # Up to the next turn's context or sequence, whichever comes first: the tokens after
        # the reply in this sequence (an env's observation, an agent's tool results).
        later = [s for s in (*segments, *starts) if s >= end]
        after = decode(ids[end : min(later, default=len(ids))])
        new = k == 0 or first != segment_start(segments, starts[k - 1])
        turns.append(
            {
                "turn": k,
                "new_sequence": new,
                "context": decode(ids[first:begin]),
                "reply": traj.replies[k] if k < len(traj.replies) else decode(ids[begin:end]),
                "observation": traj.observations[k] if k < len(traj.observations) else after,
                "reward": traj.rewards[k] if k < len(traj.rewards) else None,
                "env_reward": traj.env_rewards[k] if k < len(traj.env_rewards) else None,
                "finish_reason": traj.finish_reasons[k] if k < len(traj.finish_reasons) else None,
                "tokens": end - begin,
                "version": traj.turn_versions[k] if k < len(traj.turn_versions) else version,
                "info": traj.infos[k] if k < len(traj.infos) else {},
            }
        )
    return turns


def episode_record(
    traj: Trajectory,
    *,
    step: int,
    index: int,
    version: int,
    decode: Callable[[list[int]], str],
    max_chars: int,
    timings: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """One episode of step ``step`` (``index``: its place in the step's batch) as a plain dict.

    ``version``: the policy version that sampled turns without ``turn_versions`` of their own;
    ``decode``: token ids to text, special tokens kept (the context as the model saw it);
    ``timings``: the step's ``perf/*`` metrics. Every string is clipped to ``max_chars``."""
    turns = turn_records(traj, version, decode)
    record = {
        "step": step,
        "episode": index,
        "group": traj.group_id,
        "versions": sorted({t["version"] for t in turns}),
        "return": float(sum(traj.rewards)),
        "num_turns": traj.num_turns,
        "truncated": traj.truncated,
        "cut": traj.cut,
        "prompt": traj.prompt_text,
        "first_observation": traj.observation,
        "task_info": traj.task_info,
        "reward_parts": traj.reward_parts,
        "adapter": traj.adapter,
        "timings": dict(timings or {}),
        "turns": turns,
    }
    return plain(record, max_chars)


def encode(records: Sequence[Mapping[str, Any]]) -> list[bytes]:
    """Each record as one JSON line (UTF-8, newline-terminated)."""
    return [(json.dumps(r, ensure_ascii=False) + "\n").encode() for r in records]


def complete_lines(data: bytes) -> list[bytes]:
    """The newline-terminated lines of ``data`` (a cut-short last line left out)."""
    lines = data.splitlines(keepends=True)
    return [line for line in lines if line.endswith(b"\n")]


def parse(line: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def read_traces(path: str | Path) -> list[dict[str, Any]]:
    """The complete records of a ``traces.jsonl`` (an unfinished or unreadable line skipped)."""
    return [r for r in map(parse, complete_lines(Path(path).read_bytes())) if r is not None]


def write_atomic(path: Path, data: bytes) -> None:
    """``path`` replaced by ``data`` through a temporary file beside it (``.<name>.*.tmp``, which
    the run directory's claim removes after a crash)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class TraceWriter:
    """Appends traced steps to ``path``, keeping it within ``max_bytes`` (see the module doc)."""

    def __init__(self, path: str | Path, max_bytes: int) -> None:
        self.path, self.max_bytes = Path(path), max_bytes
        self._checked = False
        self._told: set[str] = set()

    def _once(self, key: str, msg: str, *args: Any) -> None:
        if key not in self._told:
            self._told.add(key)
            log.warning(msg, *args)

    def _lines_before(self, step: int) -> list[bytes]:
        """The file's complete records of steps before ``step``."""
        if not self.path.is_file():
            return []
        kept = []
        for line in complete_lines(self.path.read_bytes()):
            record = parse(line)
            if record is not None and int(record.get("step", -1)) < step:
                kept.append(line)
        return kept

    def write_step(self, step: int, records: Sequence[Mapping[str, Any]]) -> int:
        """Add ``records`` (one step's episodes). Returns the records written: fewer when one
        step's records alone pass ``max_bytes`` (the last ones left out, logged once)."""
        lines = encode(records)
        while lines and sum(map(len, lines)) > self.max_bytes:
            lines.pop()
            self._once(
                "step",
                "trace.max_bytes=%d holds fewer episodes than a step traces: some are left out",
                self.max_bytes,
            )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not self._checked:  # a crash's unfinished line, or steps this run traces again (a resume)
            self._checked = True
            if self.path.is_file():
                earlier = b"".join(self._lines_before(step))
                if earlier != self.path.read_bytes():
                    write_atomic(self.path, earlier)
        if not lines:
            return 0
        new = b"".join(lines)
        size = self.path.stat().st_size if self.path.is_file() else 0
        if size + len(new) <= self.max_bytes:
            with self.path.open("ab") as f:
                f.write(new)
                f.flush()
                os.fsync(f.fileno())
            return len(lines)
        # Past the bound: the newest earlier steps, whole, that fit half of it beside this one.
        room = max(self.max_bytes // 2 - len(new), 0)
        steps: dict[int, list[bytes]] = {}
        for line in complete_lines(self.path.read_bytes()) if size else []:
            record = parse(line)
            if record is not None:
                steps.setdefault(int(record.get("step", -1)), []).append(line)
        kept: list[bytes] = []
        for s in sorted(steps, reverse=True):
            size_s = sum(map(len, steps[s]))
            if size_s > room:
                break
            kept = steps[s] + kept
            room -= size_s
        self._once(
            "bound",
            "%s reached trace.max_bytes=%d: the oldest traced steps are dropped from now on",
            self.path,
            self.max_bytes,
        )
        write_atomic(self.path, b"".join(kept) + new)
        return len(lines)
