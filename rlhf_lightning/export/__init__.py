"""Export a run's policy for serving: ``python -m rlhf_lightning.export SRC --out DIR [--merge]``.

What the command writes, and its options: :mod:`rlhf_lightning.export.cli`. The parts:
:mod:`~rlhf_lightning.export.source` (what an export reads), :mod:`~rlhf_lightning.export.merge`
(``--merge``) and :mod:`~rlhf_lightning.export.files` (writing ``--out`` atomically); their names
are re-exported here.
"""

from rlhf_lightning.export.cli import export, main
from rlhf_lightning.export.files import check_out, replace_dir, staged, write_export
from rlhf_lightning.export.merge import (
    CHECKPOINT_PREFIX,
    checkpoint_weights,
    load_base,
    merge_dtype,
    merged_model,
    stored_dtype,
)
from rlhf_lightning.export.source import Source, fail, one_line, resolve

__all__ = [
    "CHECKPOINT_PREFIX",
    "Source",
    "check_out",
    "checkpoint_weights",
    "export",
    "fail",
    "load_base",
    "main",
    "merge_dtype",
    "merged_model",
    "one_line",
    "replace_dir",
    "resolve",
    "staged",
    "stored_dtype",
    "write_export",
]
