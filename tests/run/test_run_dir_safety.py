"""A finished run's directory is never damaged: a new run there is refused (unless
``overwrite=true``), and a resume that fails (a damaged, pickling or misfitting checkpoint, or a
failure inside Lightning's load) leaves every file of the run as it was."""

from __future__ import annotations

import shutil
import struct
import zipfile
from pathlib import Path

import lightning as L
import pytest
import torch

from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.run import run
from rlhf_lightning.run.validation import check_checkpoint
from tests.conftest import FAST, compose_config

pytestmark = pytest.mark.slow

QUIET = [*FAST, "trainer.val_check_interval=100", "eval.before_training=false", "eval.at_end=false"]
QUIET += ["checkpoint.every_n_steps=1", "num_threads=1"]


def config(out: Path, *overrides: str):
    return compose_config([*QUIET, *overrides], output_dir=out)


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished two-step run with step_000001.ckpt, step_000002.ckpt and last.ckpt."""
    out = tmp_path_factory.mktemp("finished") / "run"
    assert run(config(out)).exit_code == 0
    return out


@pytest.fixture
def run_dir(finished, tmp_path) -> Path:
    """This test's own copy of the finished run."""
    return Path(shutil.copytree(finished, tmp_path / "run"))


def files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def metric_steps(d: Path) -> list[str]:
    lines = (d / "metrics.csv").read_text().splitlines()
    step = lines[0].split(",").index("step")
    return sorted({line.split(",")[step] for line in lines[1:]})


def test_a_new_run_is_refused_in_a_finished_runs_directory_and_changes_nothing(run_dir):
    before = files(run_dir)
    for overrides in ([], ["seed=3"]):  # the same config, and another one
        with pytest.raises(ConfigError) as refused:
            run(config(run_dir, *overrides))
        message = str(refused.value)
        assert f"output_dir='{run_dir}'" in message and "resume=true" in message
        assert "overwrite=true" in message
    assert files(run_dir) == before
    assert run(config(run_dir, "resume=true", "trainer.max_steps=3")).exit_code == 0  # still resumable
    assert metric_steps(run_dir) == ["1", "2", "3"]


def test_overwrite_true_replaces_the_earlier_run_and_keeps_other_files(run_dir):
    (run_dir / "notes.txt").write_text("mine")
    result = run(config(run_dir, "overwrite=true", "trainer.max_steps=1"))
    assert result.exit_code == 0
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").glob("*.ckpt"))
    assert ckpts == ["last.ckpt", "step_000001.ckpt"]  # the earlier run's step 2 is gone
    assert sorted(p.name for p in (run_dir / "checkpoints" / "adapters").iterdir()) == ["last", "step_000001"]
    assert metric_steps(run_dir) == ["1"]
    assert "max_steps: 1" in (run_dir / "config.yaml").read_text()
    assert (run_dir / "notes.txt").read_text() == "mine"
    with pytest.raises(ConfigError, match=r"overwrite=True.*deletes the checkpoint"):
        run(config(run_dir, "overwrite=true", "resume=true"))


def storage_span(ckpt: Path, tensor: torch.Tensor) -> tuple[int, int]:
    """Where ``tensor``'s bytes lie in the file ``ckpt`` (offset, length): the archive entry
    whose contents are those bytes, found by comparing them."""
    data = tensor.contiguous().numpy().tobytes()
    with zipfile.ZipFile(ckpt) as archive:
        for info in archive.infolist():
            if "/data/" in info.filename and archive.read(info) == data:
                with ckpt.open("rb") as f:
                    f.seek(info.header_offset + 26)
                    name_len, extra_len = struct.unpack("<HH", f.read(4))
                return info.header_offset + 30 + name_len + extra_len, len(data)
    raise AssertionError("no archive entry holds the tensor's bytes")


def lora_key(state: dict) -> str:
    return next(k for k in sorted(state["state_dict"]) if "lora_A" in k)


def test_a_checkpoint_with_flipped_bytes_in_a_lora_matrix_is_refused_by_name(run_dir):
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    state = torch.load(ckpt, weights_only=True)
    offset, length = storage_span(ckpt, state["state_dict"][lora_key(state)])
    raw = bytearray(ckpt.read_bytes())
    for i in range(offset, offset + length, 4):
        raw[i] ^= 0x01  # the lowest mantissa bit of every float32: finite, slightly wrong values
    ckpt.write_bytes(bytes(raw))
    assert all(torch.isfinite(t).all() for t in torch.load(ckpt, weights_only=True)["state_dict"].values())
    before = files(run_dir)
    with pytest.raises(ConfigError, match=f"{ckpt} is damaged: its entry .*/data/.* fails the archive's CRC"):
        run(config(run_dir, "resume=true", "trainer.max_steps=3"))
    assert files(run_dir) == before


def test_a_checkpoint_with_nan_weights_is_refused_naming_the_tensor(run_dir):
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    state = torch.load(ckpt, weights_only=True)
    key = lora_key(state)
    state["state_dict"][key][0, 0] = float("nan")
    torch.save(state, ckpt)
    with pytest.raises(ConfigError, match=f"{ckpt} holds NaN or inf values in state_dict.{key}"):
        run(config(run_dir, "resume=true", "trainer.max_steps=3"))


class WritesMarker:
    """Unpickling this opens (creates) ``path``: a stand-in for code in a checkpoint."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


def test_a_checkpoint_with_pickled_code_is_refused_in_one_line_unexecuted(run_dir, tmp_path):
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    marker = tmp_path / "marker"
    state = torch.load(ckpt, weights_only=True)
    torch.save({**state, "extra": WritesMarker(marker)}, ckpt)
    with pytest.raises(ConfigError) as refused:
        run(config(run_dir, "resume=true", "trainer.max_steps=3"))
    message = str(refused.value)
    assert (
        f"refusing to load {ckpt}: it holds pickled objects that loading would execute (it pickles" in message
    )
    assert "\n" not in message and "weights_only=False" not in message
    assert not marker.exists()


def test_a_changed_lora_rank_is_one_line_naming_the_field_and_touches_nothing(run_dir):
    before = files(run_dir)
    older = run_dir / "checkpoints" / "step_000001.ckpt"
    with pytest.raises(ConfigError) as refused:
        run(config(run_dir, "resume=true", f"ckpt_path={older}", "model.lora.r=4", "resume_force=true"))
    message = str(refused.value)
    assert "\n" not in message and "size mismatch" not in message
    assert str(older) in message and "model.lora.r: 16 -> 4" in message
    assert files(run_dir) == before  # config.yaml as it was; metrics.csv keeps step 2's rows
    assert metric_steps(run_dir) == ["1", "2"]


class FailsToLoad(L.Callback):
    def on_load_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        raise RuntimeError("the load failed")


def test_a_resume_that_fails_inside_lightnings_load_leaves_the_run_as_it_was(run_dir):
    before = files(run_dir)
    older = run_dir / "checkpoints" / "step_000001.ckpt"
    overrides = (
        "resume=true",
        f"ckpt_path={older}",
        "trainer.max_steps=3",
        "algo.lr=0.5",
        "resume_force=true",
    )
    with pytest.raises(RuntimeError, match="the load failed"):
        run(config(run_dir, *overrides), extra_callbacks=[FailsToLoad()])
    after = files(run_dir)
    assert after == before  # config.yaml not rewritten, metrics.csv not cut to step 1
    result = run(config(run_dir, "resume=true", "trainer.max_steps=3"))  # its own resume still runs
    assert result.exit_code == 0 and metric_steps(run_dir) == ["1", "2", "3"]


def test_resume_removes_partial_files_of_a_killed_save(run_dir):
    partial = run_dir / "checkpoints" / ".last.ckpt.k1ll3d.tmp"
    partial.write_bytes(b"half a checkpoint")
    kept = run_dir / "checkpoints" / "notes.tmp"  # not one of ours (no leading dot): kept
    kept.write_text("x")
    assert run(config(run_dir, "resume=true", "trainer.max_steps=3")).exit_code == 0
    assert not partial.exists() and kept.exists()


def test_a_truncated_checkpoints_hint_names_ckpt_path(run_dir):
    last = run_dir / "checkpoints" / "last.ckpt"
    last.write_bytes(last.read_bytes()[:1000])
    with pytest.raises(ConfigError) as refused:
        check_checkpoint("resume", str(last))
    message = str(refused.value)
    assert "ckpt_path=" + str(run_dir / "checkpoints" / "step_00000") in message
    assert "resume=/" not in message and f"resume={run_dir}" not in message
