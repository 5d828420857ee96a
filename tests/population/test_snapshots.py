"""Background snapshots: written by rank 0 only, atomically (a temporary file in the same
directory, then a rename), and pruned to the newest ``keep_snapshots``."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rlhf_lightning.population.callback import KEEP_SNAPSHOTS, Member, Population


def population(out: Path, keep: int = KEEP_SNAPSHOTS) -> Population:
    """Two members off any model (no member resident: the snapshot reads the members only)."""
    pop = Population(2, 2, {}, out, snapshot_every=2, keep_snapshots=keep)
    w = torch.arange(6.0).reshape(2, 3)
    pop.members = [Member(i, {"lr": 1e-3 * (i + 1)}, [w + i], {}, {}) for i in range(2)]
    return pop


def names(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


def test_a_snapshot_is_written_under_a_temporary_name_then_renamed(tmp_path, monkeypatch):
    pop = population(tmp_path)
    final = tmp_path / "population" / "snapshot_step_000002.pt"
    seen = []
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        seen.append((Path(f), names(final.parent)))  # what the directory holds while writing
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    pop.steps = 2
    pop.snapshot(final).join()
    ((written, during),) = seen
    assert written.parent == final.parent and written.name != final.name
    assert final.name not in during  # no final-named file before the write is done
    assert names(final.parent) == [final.name]  # renamed; no temporary file left
    snap = torch.load(final, weights_only=False)
    assert snap["steps"] == 2 and torch.equal(
        snap["members"][1]["weights"][0], torch.arange(6.0).reshape(2, 3) + 1
    )


def test_a_write_that_dies_leaves_no_file_under_the_final_name(tmp_path, monkeypatch):
    pop = population(tmp_path)
    final = tmp_path / "population" / "snapshot_step_000002.pt"

    def dies(obj, f, *args, **kwargs):
        Path(f).write_bytes(b"half a snapsh")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", dies)
    monkeypatch.setattr("threading.excepthook", lambda args: None)  # the thread's error is expected
    pop.snapshot(final).join()
    assert names(final.parent) == []


@pytest.mark.parametrize("keep", [1, 2])
def test_only_the_newest_snapshots_are_kept(tmp_path, keep):
    pop = population(tmp_path, keep)
    directory = tmp_path / "population"
    directory.mkdir()
    (directory / "notes.txt").write_text("not a snapshot")
    for step in (2, 4, 6):
        pop.steps = step
        pop.snapshot(directory / f"snapshot_step_{step:06d}.pt").join()
    kept = [f"snapshot_step_{s:06d}.pt" for s in (2, 4, 6)][-keep:]
    assert names(directory) == sorted(["notes.txt", *kept])
    assert torch.load(directory / kept[-1], weights_only=False)["steps"] == 6


def test_only_rank_0_writes_snapshots(tmp_path):
    pop = population(tmp_path)
    pop.steps = 2
    assert pop.maybe_snapshot(SimpleNamespace(is_global_zero=False)) is None
    assert not (tmp_path / "population").exists()
    pop.steps = 3  # not a snapshot step
    assert pop.maybe_snapshot(SimpleNamespace(is_global_zero=True)) is None
    pop.steps = 4
    thread = pop.maybe_snapshot(SimpleNamespace(is_global_zero=True))
    assert thread is not None
    thread.join()
    assert names(tmp_path / "population") == ["snapshot_step_000004.pt"]
