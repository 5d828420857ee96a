"""Run identity: every run owns its directory, and ``resume=true`` finds *this* run.

claim_run_dir   the run directory, created and locked exclusively (``.run.lock`` holds the
                host and pid); a live run's directory is never shared: a same-second start
                of the same name gets ``<dir>_1``; a lock left by a killed process is taken over
find_resumable  the newest ``outputs/<name>/*`` run with a ``checkpoints/last.ckpt`` whose
                saved ``config.yaml`` matches this config (fields in SAFE_TO_CHANGE aside)
config_changes  what differs between two configs, key by key
refuse_reuse    an explicit ``output_dir`` holding an earlier run is refused unless the run
                resumes it (``resume=true``) or replaces it (``overwrite=true``)
hand_to_launched_ranks / handed_by_rank0
                rank 0 marks the directory it checked and claimed for the ranks Lightning's
                launcher starts from it; those skip the checks rank 0 made (an external
                launcher's ranks, torchrun's or srun's, carry no mark and check themselves)
clear_run       ``overwrite=true``: the earlier run's files removed (only the files a run writes)
remove_partials temporary files a killed save left (``.<name>.*.tmp``), once the run holds the lock
follow_resumed_run  ``resume=true`` without ``output_dir``: Hydra's job log moves to the resumed
                run's directory, and the launch's own (empty) directory is removed
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rlhf_lightning.config.errors import ConfigError

log = logging.getLogger(__name__)

LOCK = ".run.lock"
CONFIG = "config.yaml"
# Fields a resumed run may change: where it writes, how long it runs, what it logs and saves.
SAFE_TO_CHANGE = (
    "output_dir",
    "resume",
    "overwrite",
    "resume_force",
    "ckpt_path",
    "num_threads",
    "trainer.max_steps",
    "trainer.max_epochs",
    "trainer.enable_progress_bar",
    "trainer.enable_model_summary",
    "optimized_metric",
    "optimized_mode",
    "optimized_direction",
    "checkpoint.",
    "logger.",
    "samples.",
    "trace.",
    "progress.",
)


def process_rank() -> int:
    """This process's global rank from the launcher's environment (0 before any launcher)."""
    for var in ("RANK", "SLURM_PROCID", "LOCAL_RANK"):
        if os.environ.get(var):
            return int(os.environ[var])
    return 0


# Set by rank 0 once it has checked and claimed the run directory; Lightning's launcher copies
# the environment into the ranks it starts. Its value is the directory, so a stray mark (one
# exported in a shell) never matches a directory it was not set for.
HANDED_DIR = "RLHF_LIGHTNING_HANDED_RUN_DIR"


def hand_to_launched_ranks(path: Path) -> None:
    """Rank 0, after its checks and its claim of ``path``: the ranks Lightning's launcher starts
    from this process (with this environment) are handed ``path`` and skip the checks
    (:func:`handed_by_rank0`). By then rank 0 may have written there (``metrics.csv``), which
    those ranks would otherwise take for an earlier run."""
    os.environ[HANDED_DIR] = str(path.resolve())


def handed_by_rank0(path: Path) -> bool:
    """Whether this process is a rank Lightning's launcher started from a rank 0 that checked and
    claimed ``path`` (:func:`hand_to_launched_ranks`). False on every rank an external launcher
    (torchrun, srun) started: those all start at once and each checks for itself, which is safe
    because no rank writes an earlier run's mark (RUN_MARKS) before the process group is up, a
    point every rank reaches only after its own checks; so all of them refuse alike."""
    return process_rank() != 0 and os.environ.get(HANDED_DIR) == str(path.resolve())


def _holder(lock: Path) -> tuple[str, int] | None:
    try:
        host, pid = lock.read_text().split()
        return host, int(pid)
    except (OSError, ValueError):
        return None


def _is_stale(lock: Path) -> bool:
    """A lock whose process is gone (on this host; another host's lock counts as live)."""
    holder = _holder(lock)
    if holder is None:
        return True
    host, pid = holder
    if host != socket.gethostname():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return pid == os.getpid()


def claim_run_dir(path: Path, *, explicit: bool) -> Path:
    """Create and lock the run directory ``path`` (or ``path_1``, ``path_2``... when a live run
    holds it and the path came from the timestamp pattern). ``explicit``: the user named it
    (``output_dir=``): a live holder is an error, not a reason to go elsewhere."""
    candidate, n = path, 0
    while True:
        candidate.mkdir(parents=True, exist_ok=True)
        lock = candidate / LOCK
        if not explicit and (candidate / CONFIG).exists() and not lock.exists():
            n += 1  # an earlier run's results: a new run never writes over them
            candidate = path.with_name(f"{path.name}_{n}")
            continue
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            if _is_stale(lock):
                lock.unlink(missing_ok=True)
                continue
            who = "{}:{}".format(*_holder(lock) or ("?", "?"))
            if explicit:
                raise ConfigError(
                    "output_dir",
                    str(path),
                    f"a directory no live run uses ({who} holds {lock}; delete that file if the run is gone)",
                ) from None
            n += 1
            candidate = path.with_name(f"{path.name}_{n}")
            continue
        with os.fdopen(fd, "w") as f:
            f.write(f"{socket.gethostname()} {os.getpid()}")
        if candidate != path:
            log.warning("%s is in use by another run: this run writes to %s", path, candidate)
        return candidate


# What a run writes into its directory: what ``overwrite=true`` removes (and nothing else).
RUN_FILES = (CONFIG, ".hydra", "checkpoints", "metrics.csv", "hparams.yaml", "plots.png", "samples.md",
             "traces.jsonl", "tensorboard", "wandb", "population", "lineage.csv", "server_weights", "servers",
             "train.log")  # fmt: skip
# What shows that a directory holds a run (a run writes config.yaml once its checkpoint loaded).
RUN_MARKS = (CONFIG, "checkpoints", "metrics.csv")


def holds_run(path: Path) -> bool:
    return any((path / name).exists() for name in RUN_MARKS)


def refuse_reuse(path: Path, *, overwrite: bool) -> None:
    """A new run never writes into ``path`` (the user's ``output_dir``) over an earlier run's
    results, unless told to (``overwrite``); a resume of that run does not come here."""
    if overwrite or not path.is_dir() or not holds_run(path):
        return
    found = ", ".join(n for n in RUN_MARKS if (path / n).exists())
    last = path / "checkpoints" / "last.ckpt"
    if last.is_file():
        how = "continue it with resume=true, or pass overwrite=true to delete its results and start a new run there"
    else:  # a run that ended before its first checkpoint: nothing to resume
        how = (
            f"it has no {last} to resume; pass overwrite=true to delete its results and start a new run there"
        )
    raise ConfigError(
        "output_dir",
        str(path),
        f"a directory without an earlier run: {path} holds one ({found}); {how} (or choose another output_dir)",
    )


def clear_run(path: Path) -> None:
    """``overwrite=true``: the files an earlier run wrote in ``path`` (RUN_FILES) removed; a log
    file still open (Hydra's ``train.log``) is emptied instead. Other files are left alone."""
    for name in RUN_FILES:
        p = path / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif name == "train.log" and p.is_file():
            os.truncate(p, 0)
        elif p.exists() or p.is_symlink():
            p.unlink()
    log.info("overwrite=true: removed the earlier run's files from %s", path)


def remove_partials(path: Path) -> None:
    """Remove the temporary files of saves a killed run left in ``path`` and its ``checkpoints``
    (``.<name>.<random>.tmp``, see ``write_atomic`` and ``atomic_torch_save``). Call it only
    while holding the directory's lock: no live run is writing them then."""
    for d in (path, path / "checkpoints", path / ".hydra"):
        for p in d.glob(".*.tmp"):
            if p.is_file() and not p.is_symlink():
                log.info("removing %s, a partial file left by an interrupted save", p)
                p.unlink(missing_ok=True)


def follow_resumed_run(launch_dir: Path, run_dir: Path) -> None:
    """``resume=true`` without ``output_dir`` continues an earlier run's directory: the file logs
    Hydra opened in the directory it made for this launch (``train.log``) move to ``run_dir``
    (appended to that run's), and the launch's directory, then empty, is removed rather than left
    as an orphan holding only this run's log."""
    if launch_dir.resolve() == run_dir.resolve():
        return
    for handler in logging.getLogger().handlers:
        if not isinstance(handler, logging.FileHandler):
            continue
        old = Path(handler.baseFilename)
        if old.parent != launch_dir.resolve() or handler.mode == "w":
            continue
        new = run_dir.resolve() / old.name
        handler.acquire()
        try:
            handler.close()  # reopened (mode "a") at the next record, at its new place
            if old.is_file():
                with old.open("rb") as src, new.open("ab") as dst:
                    shutil.copyfileobj(src, dst)
                old.unlink()
            handler.baseFilename = os.fspath(new)
        finally:
            handler.release()
    with contextlib.suppress(OSError):  # not empty: something else was written there; left as it is
        launch_dir.rmdir()


def release_run_dir(path: Path) -> None:
    lock = path / LOCK
    holder = _holder(lock)
    if holder is not None and holder == (socket.gethostname(), os.getpid()):
        lock.unlink(missing_ok=True)


def _flat(cfg: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(cfg, dict):
        for k, v in cfg.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    out[prefix[:-1]] = cfg
    return out


def config_changes(saved: DictConfig, current: DictConfig) -> list[str]:
    """``key: saved -> current`` for every field that differs, SAFE_TO_CHANGE aside."""
    a = _flat(OmegaConf.to_container(saved, resolve=False, enum_to_str=True))
    b = _flat(OmegaConf.to_container(current, resolve=False, enum_to_str=True))
    out = []
    for key in sorted(a.keys() | b.keys()):
        if any(key == s or (s.endswith(".") and key.startswith(s)) for s in SAFE_TO_CHANGE):
            continue
        if a.get(key, "<absent>") != b.get(key, "<absent>"):
            out.append(f"{key}: {a.get(key, '<absent>')!r} -> {b.get(key, '<absent>')!r}")
    return out


def write_atomic(path: Path, text: str) -> None:
    """``path`` written through a temporary file beside it (never half-written)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_run_config(cfg: DictConfig, run_dir: Path) -> None:
    """``config.yaml`` and, under Hydra, ``.hydra/{config,overrides,hydra}.yaml``: written once
    the run owns ``run_dir`` (Hydra's own copy is off, ``hydra.output_subdir: null``, since it
    would be written before the claim: over a live run's files)."""
    write_atomic(run_dir / CONFIG, OmegaConf.to_yaml(cfg))
    try:
        from hydra.core.hydra_config import HydraConfig

        hc = HydraConfig.get()
    except (ImportError, ValueError):  # not under @hydra.main (the Python API)
        return
    hydra_dir = run_dir / ".hydra"
    write_atomic(hydra_dir / "config.yaml", OmegaConf.to_yaml(cfg))
    write_atomic(hydra_dir / "overrides.yaml", OmegaConf.to_yaml(OmegaConf.create(list(hc.overrides.task))))
    write_atomic(hydra_dir / "hydra.yaml", OmegaConf.to_yaml(OmegaConf.create({"hydra": hc})))


def check_same_run(cfg: DictConfig, run_dir: Path, force: bool) -> None:
    """Refuse to resume ``run_dir`` with a config that differs in more than SAFE_TO_CHANGE."""
    saved_path = run_dir / CONFIG
    if not saved_path.is_file():
        return  # a checkpoint from elsewhere (or an older run): nothing to compare with
    changes = config_changes(OmegaConf.load(saved_path), cfg)  # type: ignore[arg-type]
    if changes and not force:
        shown = "; ".join(changes[:8]) + (f"; ... ({len(changes)} in all)" if len(changes) > 8 else "")
        raise ConfigError(
            "resume",
            str(run_dir),
            f"the same config as the checkpoint's run, which differs in: {shown} "
            "(resume_force=true resumes anyway)",
        )


def find_resumable(root: Path, cfg: DictConfig, exclude: Path | None = None, pattern: str = "*") -> Path:
    """The newest run ``root/<pattern>`` (``outputs/<name>/*``; a multirun's jobs:
    ``outputs/<name>/multirun/*/*``) with a last checkpoint and this config."""
    runs = sorted(
        (p.parent.parent for p in root.glob(f"{pattern}/checkpoints/last.ckpt")),
        key=lambda d: (d / "checkpoints" / "last.ckpt").stat().st_mtime,
        reverse=True,
    )
    runs = [d for d in runs if exclude is None or d.resolve() != exclude.resolve()]
    mismatched = []
    for d in runs:
        saved = d / CONFIG
        changes = config_changes(OmegaConf.load(saved), cfg) if saved.is_file() else ["<no config.yaml>"]  # type: ignore[arg-type]
        if not changes:
            return d
        mismatched.append(f"{d.name} ({changes[0]}{', ...' if len(changes) > 1 else ''})")
    why = f"; runs with another config: {', '.join(mismatched[:3])}" if mismatched else ""
    raise ConfigError(
        "resume",
        True,
        f"a run of this config with checkpoints/last.ckpt under {root}/{pattern}{why}; pass output_dir=<run dir> "
        "or ckpt_path=..., or drop resume",
    )
