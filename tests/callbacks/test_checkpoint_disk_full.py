"""A checkpoint save that runs out of disk space says so, naming the file and the free space,
instead of torch's bare "unexpected pos" / ENOSPC; nothing is left under the checkpoint's name."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

from rlhf_lightning.callbacks import checkpoints


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (every write: ENOSPC)")
def test_a_full_disk_during_a_checkpoint_names_the_path_and_free_space(tmp_path, monkeypatch):
    target = tmp_path / "checkpoints" / "step_000004.ckpt"
    staged = tmp_path / "checkpoints" / ".step_000004.ckpt.x.tmp"
    # The temporary file is /dev/full: the write fails as it does on a full disk.
    monkeypatch.setattr(
        checkpoints.tempfile, "mkstemp", lambda **kwargs: (os.open("/dev/full", os.O_WRONLY), str(staged))
    )
    with pytest.raises(OSError) as err:
        checkpoints.atomic_torch_save({"w": torch.ones(100_000)}, target)
    assert err.value.errno == errno.ENOSPC
    message = str(err.value)
    assert f"checkpoint {target} not written: no space left on its filesystem (" in message
    assert "MiB free now" in message and "lower checkpoint.keep_last" in message
    assert not target.exists()


def test_other_save_errors_pass_through_unchanged(tmp_path):
    with pytest.raises(AttributeError, match=r"Can't (pickle|get local object)"):
        checkpoints.atomic_torch_save({"f": lambda: 0}, tmp_path / "x.ckpt")
    assert list(tmp_path.iterdir()) == []  # the temporary file is removed too
