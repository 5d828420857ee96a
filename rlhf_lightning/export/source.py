"""What an export reads: a run directory or an adapter directory resolved into a :class:`Source`
(the base model, its tokenizer settings, the adapters or the full fine-tuning checkpoint), and
the CLI's one-line errors (:func:`fail`)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from rlhf_lightning.models.adapters import ACTOR, CRITIC, adapter_dir


@dataclass
class Source:
    """What an export reads: the base model (and how to load it), its tokenizer settings, and
    the adapters or checkpoint."""

    base: str
    tokenizer: str
    tokenizer_kwargs: dict[str, Any]
    actor: Path | None  # the actor adapter (None: full fine-tuning)
    critic: Path | None
    checkpoint: Path | None = None  # full fine-tuning: the Lightning checkpoint with the weights
    revision: str | None = None  # the base's (and tokenizer's) Hub revision
    # Run the base's own code: only with --trust-remote-code, never because a run directory
    # (someone else's, perhaps) asks for it; the run's own setting is kept to explain a failure.
    trust_remote_code: bool = False
    run_trust_remote_code: bool = False
    dtype: str = "auto"  # the run's model.dtype: what a merge is cast to unless --dtype says otherwise


def one_line(err: BaseException) -> str:
    """``err``'s message on one line (library messages span several), at most 400 characters."""
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= 400 else text[:397] + "..."


def fail(message: str) -> SystemExit:
    """The CLI's error: one line, ``error: ...`` (``raise fail(...)``)."""
    return SystemExit("error: " + " ".join(message.split()))


# The project's own resolvers: the only interpolations an export resolves in a run directory.
OWN_RESOLVERS = ("asset", "or_default")
_RESOLVER = re.compile(r"\$\{\s*([A-Za-z_][\w.]*)\s*:")
_BLOCKED = "\x00blocked-interpolation\x00"


def _blocked(value: str) -> str | None:
    """The first resolver in ``value`` that is not the project's own (``oc.env``...), or None."""
    return next((name for name in _RESOLVER.findall(value) if name not in OWN_RESOLVERS), None)


def _scrubbed(node: Any) -> Any:
    """``node`` (a raw config container) with every string that calls another resolver replaced
    by a marker: resolving the rest can reach neither the environment nor any other outside value."""
    if isinstance(node, dict):
        return {k: _scrubbed(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_scrubbed(v) for v in node]
    return _BLOCKED if isinstance(node, str) and _blocked(node) else node


def _run_model_config(config: Path) -> dict[str, Any]:
    """``model.*`` of a run's ``config.yaml``. A run directory may come from anyone: of its
    interpolations only the project's own (``${asset:...}``) and references to other fields are
    resolved; a model field that needs any other (``${oc.env:NAME}``, which would copy a variable
    of this environment into the export) is refused."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from rlhf_lightning.config import register_configs

    register_configs()  # the ${asset:NAME} resolver the embedded models' paths use
    try:
        raw = OmegaConf.to_container(OmegaConf.load(config), resolve=False)
        raw_model = raw.get("model") if isinstance(raw, dict) else None
        cfg = OmegaConf.create(_scrubbed(raw))
        model = OmegaConf.to_container(cfg.model, resolve=True, enum_to_str=True)
    except (OmegaConfBaseException, OSError, ValueError) as err:
        raise fail(
            f"cannot read model.* from {config} ({one_line(err)}); give a run directory written by "
            "train.py, or an adapter directory with --base"
        ) from err
    if not isinstance(model, dict) or not model.get("path"):
        raise fail(f"{config} has no model.path; give a run directory written by train.py")
    for key, value in cast(dict[str, Any], model).items():
        if isinstance(value, str) and _BLOCKED in value:
            shown = raw_model.get(key) if isinstance(raw_model, dict) else None
            raise fail(
                f"{config} sets model.{key} through an interpolation export does not resolve "
                f"({shown!r}: only ${{asset:...}} and references to other fields are, so that a run "
                "directory cannot copy this environment's variables into the export); write the value "
                f"itself into model.{key} of {config}"
            )
    return cast(dict[str, Any], model)


def _choices(directory: Path, pattern: str, suffix: str = "") -> str:
    found = sorted(p.name.removesuffix(suffix) for p in directory.glob(pattern))
    return str(found) if found else "none (the run saved no checkpoint)"


def _run_source(src: Path, which: str, base: str | None) -> Source:
    """A run directory's :class:`Source`: the base from ``config.yaml``, ``--which``'s weights."""
    config = src / "config.yaml"
    m = _run_model_config(config)
    base_path = base or str(m["path"])
    kwargs = {"pad_token": m.get("pad_token"), "chat_template": m.get("chat_template")}
    revision, run_trust, dtype = (
        m.get("revision"),
        m.get("trust_remote_code") is True,
        str(m.get("dtype") or "auto"),
    )
    tokenizer = str(m.get("tokenizer_path") or base_path)
    ckpts = src / "checkpoints"
    if m.get("finetune", "lora") == "full":
        ckpt = ckpts / f"{which}.ckpt"
        if not ckpt.is_file():
            raise fail(
                f"a full fine-tuning run exports from {ckpt}, which does not exist; choose --which "
                f"among {_choices(ckpts, '*.ckpt', '.ckpt')}"
            )
        return Source(base_path, tokenizer, kwargs, None, None, ckpt, revision, False, run_trust, dtype)
    adapters = ckpts / "adapters" / which
    if not adapters.is_dir():
        hint = ""
        if which == "best" and (ckpts / "best.ckpt").is_file():
            hint = (
                " (the run wrote best.ckpt but not adapters/best: it predates adapters/best or ran "
                "with checkpoint.export_adapters=false)"
            )
        raise fail(f"no adapters {adapters}{hint}; choose --which among {_choices(ckpts / 'adapters', '*')}")
    actor = adapter_dir(adapters, ACTOR)
    if actor is None:
        raise fail(
            f"{adapters} holds no actor adapter (actor/adapter_config.json): the run's export is incomplete"
        )
    critic = adapter_dir(adapters, CRITIC)
    return Source(base_path, tokenizer, kwargs, actor, critic, None, revision, False, run_trust, dtype)


def _adapter_source(src: Path, base: str | None) -> Source:
    """An adapter directory's :class:`Source`: the base from ``--base`` or ``adapter_config.json``."""
    actor = adapter_dir(src, ACTOR)
    if actor is None:
        raise fail(
            f"{src} holds no actor adapter (actor/adapter_config.json or adapter_config.json); give a "
            "run directory or an adapter directory"
        )
    config = actor / "adapter_config.json"
    try:
        saved = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise fail(f"cannot read {config} ({one_line(err)}); re-export the adapter") from err
    base_path = base or (saved.get("base_model_name_or_path") if isinstance(saved, dict) else None) or ""
    if not base_path:
        raise fail(f"{config} names no base model (base_model_name_or_path); pass --base PATH")
    revision = saved.get("revision") if isinstance(saved, dict) else None
    return Source(base_path, base_path, {}, actor, adapter_dir(src, CRITIC), revision=revision)


def resolve(
    src: Path,
    which: str = "last",
    base: str | None = None,
    *,
    revision: str | None = None,
    trust_remote_code: bool | None = None,
) -> Source:
    """Read ``src`` (a run directory or an adapter directory) into a :class:`Source`;
    ``revision`` (given: not None) overrides the run's or the adapter's. The base's own code runs
    only with ``trust_remote_code=True`` (the CLI's ``--trust-remote-code``), whatever the run's
    ``model.trust_remote_code`` says: a run directory is data, and may come from anyone."""
    src = Path(src)
    if not src.is_dir():
        raise fail(f"{src} is not a directory; give a run directory or an adapter directory")
    source = _run_source(src, which, base) if (src / "config.yaml").is_file() else _adapter_source(src, base)
    source.tokenizer_kwargs["need_chat_template"] = False
    if revision is not None:
        source.revision = revision
    source.trust_remote_code = trust_remote_code is True
    return source


def remote_code_hint(source: Source) -> str:
    """For a failed load: the run asked for the base's own code, which export runs only when told."""
    if source.run_trust_remote_code and not source.trust_remote_code:
        return (
            "; the run was trained with model.trust_remote_code=true, but export never runs a model's "
            "own code because a run directory says so: if you trust this base, pass --trust-remote-code"
        )
    return ""
