"""traces/writer.py by hand: turns cut from the token ids (one sequence and several), the size
bound (oldest whole steps dropped, the file never past it), and crash safety (a cut-short line is
never read as an episode and is removed by the next writer)."""

from __future__ import annotations

import json
import logging

from rlhf_lightning.records.trajectory import Trajectory
from rlhf_lightning.traces.writer import TraceWriter, clip_text, episode_record, read_traces

# token id -> one character: what a tokenizer's decode would return, checkable by eye
VOCAB = {i: c for i, c in enumerate("PQRSTabcdefgxyzUVW")}


def decode(ids: list[int]) -> str:
    return "".join(VOCAB[i] for i in ids)


def two_turns(segment_starts: list[int]) -> Trajectory:
    """Prompt PQR, reply ab, observation ST, reply cd (then nothing: the episode ended)."""
    return Trajectory(
        token_ids=[0, 1, 2, 5, 6, 3, 4, 7, 8],
        action_turn=[-1, -1, -1, 0, 0, -1, -1, 1, 1],
        sampling_logps=[0.0] * 9,
        rewards=[-0.5, 2.0],
        group_id=3,
        prompt_len=3,
        finish_reasons=["stop", "length"],
        turn_lengths=[2, 2],
        replies=["ab", "cd"],
        infos=[{"valid": False}, {"valid": True}],
        segment_starts=segment_starts,
    )


def test_one_sequence_turns_see_the_whole_conversation():
    rec = episode_record(two_turns([0]), step=7, index=1, version=6, decode=decode, max_chars=0)
    t0, t1 = rec["turns"]
    assert (t0["context"], t0["reply"], t0["observation"]) == ("PQR", "ab", "ST")
    assert (t1["context"], t1["reply"], t1["observation"]) == ("PQRabST", "cd", "")
    assert [t["reward"] for t in rec["turns"]] == [-0.5, 2.0] and rec["return"] == 1.5
    assert [t["finish_reason"] for t in rec["turns"]] == ["stop", "length"]
    assert [t["new_sequence"] for t in rec["turns"]] == [True, False]
    assert [t["version"] for t in rec["turns"]] == [6, 6] and rec["versions"] == [6]
    assert (rec["step"], rec["episode"], rec["group"], rec["num_turns"]) == (7, 1, 3, 2)
    assert [t["info"] for t in rec["turns"]] == [{"valid": False}, {"valid": True}]


def test_a_turn_that_starts_a_sequence_sees_only_its_own():
    # history=last: the second turn's prompt ST is a sequence of its own (an agent's restart too)
    traj = two_turns([0, 5])
    traj.turn_versions = [4, 5]  # asynchronous rollouts: each turn's own version
    rec = episode_record(traj, step=7, index=0, version=6, decode=decode, max_chars=0)
    t0, t1 = rec["turns"]
    assert (t0["context"], t0["observation"]) == ("PQR", "")  # nothing follows ab in its sequence
    assert (t1["context"], t1["new_sequence"]) == ("ST", True)
    assert [t["version"] for t in rec["turns"]] == [4, 5] and rec["versions"] == [4, 5]


def test_the_env_observation_is_kept_as_the_env_gave_it():
    traj = two_turns([0])
    traj.observations = [[{"role": "tool", "content": "42"}]]  # chat messages
    rec = episode_record(traj, step=1, index=0, version=0, decode=decode, max_chars=0)
    assert rec["turns"][0]["observation"] == [{"role": "tool", "content": "42"}]


def test_text_fields_are_clipped_head_and_tail():
    text = "0123456789" * 10
    clipped = clip_text(text, 40)
    assert len(clipped) == 40 and clipped.startswith("0123") and clipped.endswith("789")
    assert "[60 chars cut]" in clipped
    assert clip_text(text, 0) == text and clip_text("short", 40) == "short"
    traj = two_turns([0])
    traj.replies = ["x" * 500, "cd"]
    rec = episode_record(traj, step=1, index=0, version=0, decode=decode, max_chars=50)
    assert len(rec["turns"][0]["reply"]) == 50


def step_records(step: int, n: int, width: int) -> list[dict]:
    return [{"step": step, "episode": i, "pad": "x" * width} for i in range(n)]


def test_the_bound_drops_the_oldest_whole_steps(tmp_path, caplog):
    path = tmp_path / "traces.jsonl"
    line = len(json.dumps(step_records(0, 1, 200)[0])) + 1  # bytes of one record's line
    bound = 10 * line  # 3 steps of 2 records fit, a 4th passes the bound and keeps half
    writer = TraceWriter(path, bound)
    sizes, held = [], []
    with caplog.at_level(logging.WARNING):
        for step in range(1, 9):
            assert writer.write_step(step, step_records(step, 2, 200)) == 2
            sizes.append(path.stat().st_size)
            steps = [r["step"] for r in read_traces(path)]
            held.append(steps)
            assert steps[-2:] == [step, step]  # the newest step whole, always
            assert all(steps.count(s) == 2 for s in steps)  # whole steps only
            assert steps == sorted(steps) and set(steps) == set(range(steps[0], step + 1))  # no gap
    assert max(sizes) <= bound
    assert sizes[:5] == [2 * line * k for k in range(1, 6)]  # appended until the bound
    # step 6 passes it: the newest steps within half the bound remain (5 and 6), then 7, 8 append
    assert held[5] == [5, 5, 6, 6] and sizes[5] == 4 * line
    assert held[7] == [5, 5, 6, 6, 7, 7, 8, 8]
    assert sum("dropped" in r.message for r in caplog.records) == 1  # said once


def test_a_step_larger_than_the_bound_keeps_what_fits(tmp_path):
    path = tmp_path / "traces.jsonl"
    line = len(json.dumps(step_records(0, 1, 200)[0])) + 1
    writer = TraceWriter(path, 3 * line + 10)
    assert writer.write_step(1, step_records(1, 5, 200)) == 3
    assert [r["episode"] for r in read_traces(path)] == [0, 1, 2]
    assert path.stat().st_size <= 3 * line + 10


def test_a_cut_short_line_is_never_an_episode(tmp_path):
    path = tmp_path / "traces.jsonl"
    TraceWriter(path, 10**6).write_step(1, step_records(1, 2, 10))
    TraceWriter(path, 10**6).write_step(2, step_records(2, 1, 10))
    whole = path.read_bytes()
    # a crash in the middle of step 3's write: a complete first record, half of the second
    third = b"".join(json.dumps(r).encode() + b"\n" for r in step_records(3, 2, 10))
    path.write_bytes(whole + third[: len(third) - 7])
    assert [(r["step"], r["episode"]) for r in read_traces(path)] == [(1, 0), (1, 1), (2, 0), (3, 0)]
    # the resumed run traces step 3 again: the file holds steps 1, 2 and the new step 3 only
    TraceWriter(path, 10**6).write_step(3, step_records(3, 2, 10))
    lines = path.read_bytes().splitlines(keepends=True)
    assert all(line.endswith(b"\n") for line in lines)
    assert [(r["step"], r["episode"]) for r in map(json.loads, lines)] == [
        (1, 0),
        (1, 1),
        (2, 0),
        (3, 0),
        (3, 1),
    ]
    assert not list(tmp_path.glob(".*.tmp"))  # the rewrite's temporary file is gone
