"""Writing an export: ``--out`` checked (new or empty, outside what the export reads), the files
written into a directory beside it and moved into place at the end, so that a failed export
leaves ``--out`` as it was."""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf_lightning.export.source import Source, fail
from rlhf_lightning.models.adapters import CRITIC


def check_out(out: Path, force: bool, reads: list[Path], copied: list[Path]) -> None:
    """Refuse an ``--out`` that is a file, non-empty without ``force``, is or holds a path the
    export reads (``reads``: replacing ``out`` would delete it), or lies inside a directory the
    export copies (``copied``)."""
    if out.exists() and not out.is_dir():
        raise fail(f"--out {out} is a file; give a directory")
    here = out.resolve()
    for src in reads + copied:
        p = src.resolve()
        if here == p or here in p.parents or (src in copied and p in here.parents):
            raise fail(f"--out {out} overlaps the export's source {src}; choose a directory outside it")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise fail(
            f"--out {out} is not empty (an earlier export's files would mix with this one's); "
            "choose a new or empty directory, or pass --force to replace its contents"
        )


def replace_dir(new: Path, out: Path) -> None:
    """Move the finished directory ``new`` to ``out`` (same parent), replacing what is there; if
    the final move fails, the previous ``out`` is put back."""
    if out.is_dir() and not out.is_symlink() and not any(out.iterdir()):
        out.rmdir()
    if not os.path.lexists(out):
        os.replace(new, out)
        return
    old = out.with_name(f".{out.name}.old-{secrets.token_hex(4)}")
    os.replace(out, old)
    try:
        os.replace(new, out)
    except BaseException:
        os.replace(old, out)
        raise
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old, ignore_errors=True)
    else:
        old.unlink()


@contextmanager
def staged(out: Path) -> Iterator[Path]:
    """A new directory beside ``out`` to write the export into; it replaces ``out`` when the
    block finishes, and is deleted if the block fails (``out`` untouched)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.partial-{secrets.token_hex(4)}")
    tmp.mkdir()
    try:
        yield tmp
        replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already after a successful move


def write_export(
    tmp: Path, source: Source, model: PreTrainedModel | None, tokenizer: PreTrainedTokenizerBase
) -> None:
    """Write the merged ``model`` (or, None, the actor adapter), the tokenizer and the critic to ``tmp``."""
    if model is not None:
        model.save_pretrained(tmp)  # config, generation config, safetensors weights
    else:
        assert source.actor is not None
        for f in source.actor.iterdir():
            if f.is_file():
                shutil.copy2(f, tmp / f.name)
    tokenizer.save_pretrained(tmp)  # with the chat template the run used
    if source.critic is not None:
        shutil.copytree(source.critic, tmp / CRITIC)
