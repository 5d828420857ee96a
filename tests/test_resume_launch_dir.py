"""``resume=true`` without ``output_dir`` from the command line: the run continues the newest
run of its config, its log goes there, and no directory of the launch's own is left behind."""

from __future__ import annotations

import pytest

from tests.test_resume import rows, run_here, train

pytestmark = pytest.mark.slow


def test_resume_true_without_output_dir_leaves_no_orphan_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the runs' outputs/ (train.py's default place) is this test's
    base = ["name=orphan", "trainer.max_steps=2", "checkpoint.every_n_steps=2"]
    mine = tmp_path / "outputs" / "orphan" / "mine"
    run_here(*base, f"output_dir={mine}")
    (mine / "train.log").write_text("the first launch's log\n")
    train(tmp_path, *base, "trainer.max_steps=3", "resume=true")
    assert [p.name for p in (tmp_path / "outputs" / "orphan").iterdir()] == ["mine"]
    log = (mine / "train.log").read_text()
    assert log.startswith("the first launch's log\n")  # appended to, not replaced
    assert f"resuming from {mine / 'checkpoints' / 'last.ckpt'}" in log
    assert [k for k in rows(mine) if " " not in k] == ["1", "2", "3"]
