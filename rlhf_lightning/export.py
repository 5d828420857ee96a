"""Export a run's policy for serving: ``python -m rlhf_lightning.export SRC --out DIR [--merge]``.

``SRC`` is a run directory (``outputs/<name>/<time>``: its ``config.yaml`` names the base model,
its revision and tokenizer; ``checkpoints/adapters/<which>`` holds the adapters) or an adapter
directory (``actor/``, ``critic/``, or a bare PEFT adapter; the base comes from its
``adapter_config.json`` or ``--base``).

- Without ``--merge``: ``DIR`` is the actor's PEFT adapter with the tokenizer and chat template
  (``PeftModel.from_pretrained(base, DIR)``; vLLM serves it with ``--enable-lora``).
- With ``--merge``: ``DIR`` is a plain transformers model, the adapter folded into the base
  weights, with the tokenizer and chat template (``AutoModelForCausalLM.from_pretrained(DIR)``,
  ``vllm serve DIR``). A full fine-tuning run is exported this way from its ``<which>.ckpt``.
  The merge is done in float32 (memory: 4 bytes per parameter) and the result cast once to
  ``--dtype`` (default: the run's ``model.dtype``, else the base checkpoint's dtype): each weight
  is rounded once, and a float32 run keeps LoRA deltas smaller than bf16's spacing.
- PPO's critic (adapter + ``value_head.safetensors``) is copied to ``DIR/critic``, never merged.
- ``--which best``: the adapters (or, full fine-tuning, ``best.ckpt``) of the evaluation with the
  best ``checkpoint.monitor``.
- ``DIR`` must be new or empty; ``--force`` replaces a non-empty one. The export is written to a
  directory beside ``DIR`` and moved into place at the end: a failed export leaves ``DIR`` as it
  was (absent, or the previous export).
- Checkpoints load with ``torch.load(weights_only=True)``: one holding other pickled objects
  (which loading would execute) is refused.
- ``--push-to-hub REPO`` uploads ``DIR`` to the Hugging Face Hub (``huggingface-cli login`` first).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import secrets
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf_lightning.errors import ConfigError
from rlhf_lightning.models.adapters import ACTOR, CRITIC, adapter_dir
from rlhf_lightning.models.build import DTYPES, load_model, load_tokenizer

CHECKPOINT_PREFIX = "policy.model."  # the LightningModule's keys for the wrapped model's weights


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
    trust_remote_code: bool = False
    dtype: str = "auto"  # the run's model.dtype: what a merge is cast to unless --dtype says otherwise


def one_line(err: BaseException) -> str:
    """``err``'s message on one line (library messages span several), at most 400 characters."""
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= 400 else text[:397] + "..."


def fail(message: str) -> SystemExit:
    """The CLI's error: one line, ``error: ...`` (``raise fail(...)``)."""
    return SystemExit("error: " + " ".join(message.split()))


def _run_model_config(config: Path) -> dict[str, Any]:
    """``model.*`` of a run's ``config.yaml``, interpolations (``${asset:...}``) resolved."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from rlhf_lightning.config import register_configs

    register_configs()  # the ${asset:NAME} resolver the embedded models' paths use
    try:
        cfg = OmegaConf.load(config)
        model = OmegaConf.to_container(cfg.model, resolve=True)
    except (OmegaConfBaseException, OSError, ValueError) as err:
        raise fail(
            f"cannot read model.* from {config} ({one_line(err)}); give a run directory written by "
            "train.py, or an adapter directory with --base"
        ) from err
    if not isinstance(model, dict) or not model.get("path"):
        raise fail(f"{config} has no model.path; give a run directory written by train.py")
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
    revision, trust, dtype = (
        m.get("revision"),
        bool(m.get("trust_remote_code")),
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
        return Source(base_path, tokenizer, kwargs, None, None, ckpt, revision, trust, dtype)
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
    return Source(base_path, tokenizer, kwargs, actor, critic, None, revision, trust, dtype)


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
    ``revision`` / ``trust_remote_code`` (given: not None) override the run's or the adapter's."""
    src = Path(src)
    if not src.is_dir():
        raise fail(f"{src} is not a directory; give a run directory or an adapter directory")
    source = _run_source(src, which, base) if (src / "config.yaml").is_file() else _adapter_source(src, base)
    source.tokenizer_kwargs["need_chat_template"] = False
    if revision is not None:
        source.revision = revision
    if trust_remote_code is not None:
        source.trust_remote_code = trust_remote_code
    return source


def merge_dtype(requested: str, run_dtype: str, stored: str | None) -> str:
    """The dtype a merged model is saved in: ``--dtype``, else the run's ``model.dtype``, else
    the base checkpoint's stored dtype (``stored``; float32 when unknown or not one of DTYPES)."""
    for name in (requested, run_dtype):
        if name != "auto":
            return name
    return stored if stored in DTYPES else "float32"


def stored_dtype(source: Source) -> str | None:
    """The dtype the base checkpoint is saved in (its ``config.json``), e.g. ``"bfloat16"``."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(
            source.base, revision=source.revision, trust_remote_code=source.trust_remote_code
        )
    except (OSError, ValueError):
        return None  # loading the base itself fails next, with the message
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    return str(dtype).removeprefix("torch.") if dtype is not None else None


def checkpoint_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    """The model weights in a Lightning checkpoint, loaded without unpickling arbitrary objects.

    ``weights_only=True``: a file that holds other pickled objects (which loading would execute)
    is refused; our checkpoints hold only tensors and plain values. ``mmap``: optimizer states are
    never read into memory."""
    try:
        state = torch.load(ckpt, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
        why = f"it pickles {found.group(1)}" if found else one_line(err)
        raise fail(
            f"refusing to load {ckpt}: it holds pickled objects that loading would execute ({why}), "
            "which rlhf_lightning's checkpoints never do; export only checkpoints written by "
            "train.py, or re-save a trusted file's state_dict with torch.save"
        ) from err
    except (RuntimeError, OSError, EOFError, ValueError) as err:
        raise fail(
            f"cannot read {ckpt} ({one_line(err)}); is it a Lightning checkpoint written by train.py?"
        ) from err
    weights = state.get("state_dict") if isinstance(state, dict) else None
    if not isinstance(weights, dict):
        raise fail(f"{ckpt} has no state_dict; is it a Lightning checkpoint written by train.py?")
    return {k[len(CHECKPOINT_PREFIX) :]: v for k, v in weights.items() if k.startswith(CHECKPOINT_PREFIX)}


def load_base(source: Source, dtype: str) -> PreTrainedModel:
    """The base model in ``dtype``, with the run's revision and trust_remote_code, in eval mode."""
    try:
        model = load_model(
            source.base, dtype=dtype, revision=source.revision, trust_remote_code=source.trust_remote_code
        )
    except (OSError, ValueError, RuntimeError) as err:
        raise fail(
            f"cannot load the base model {source.base!r} ({one_line(err)}); pass --base with a local "
            "copy of the model the run trained"
        ) from err
    return model.eval()


def merged_model(source: Source, dtype: str = "auto") -> PreTrainedModel:
    """The base with the actor adapter folded in (or a full fine-tuning checkpoint's weights),
    in ``merge_dtype(dtype, source.dtype, stored)``.

    Everything happens in float32 and is cast once at the end. Merging in bf16 instead rounds
    twice when the base is stored in float32 (base to bf16, then base + delta); and saving a
    float32 run in its base checkpoint's bf16 loses every delta below bf16's spacing."""
    stored = stored_dtype(source) if dtype == "auto" and source.dtype == "auto" else None
    target = DTYPES[merge_dtype(dtype, source.dtype, stored)]
    weights = checkpoint_weights(source.checkpoint) if source.checkpoint is not None else None
    model = load_base(source, "float32")
    if weights is not None:
        missing, unexpected = model.load_state_dict(weights, strict=False)  # copies: cast to float32
        tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
        if set(missing) - tied or unexpected:
            raise fail(
                f"{source.checkpoint} does not match {source.base}: missing {sorted(missing)[:3]}, "
                f"unexpected {sorted(unexpected)[:3]}; pass --base with the model the run trained"
            )
    else:
        from peft import PeftModel

        try:
            peft = PeftModel.from_pretrained(model, str(source.actor))
        except (OSError, ValueError, RuntimeError, KeyError) as err:
            raise fail(
                f"cannot apply the adapter {source.actor} to {source.base!r} ({one_line(err)}); pass "
                "--base with the model the adapter was trained on"
            ) from err
        model = cast(PreTrainedModel, peft.merge_and_unload())  # W + B A * scale, in float32
    torch.nn.Module.to(model, target)  # the one rounding (in place)
    model.config.dtype = target  # config.json names the saved dtype
    return model


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


def _load_tokenizer(source: Source) -> PreTrainedTokenizerBase:
    try:
        return load_tokenizer(
            source.tokenizer,
            revision=source.revision,
            trust_remote_code=source.trust_remote_code,
            **source.tokenizer_kwargs,
        )
    except (ConfigError, OSError, ValueError, RuntimeError) as err:
        raise fail(
            f"cannot load the tokenizer {source.tokenizer!r} ({one_line(err)}); pass --base with a "
            "local copy of the run's model and its tokenizer"
        ) from err


def _local(paths: list[str | Path | None]) -> list[Path]:
    """The paths among ``paths`` that exist here (a Hub id does not)."""
    return [Path(p) for p in paths if p is not None and Path(p).exists()]


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


def export(
    src: Path,
    out: Path,
    *,
    merge: bool = False,
    which: str = "last",
    base: str | None = None,
    dtype: str = "auto",
    force: bool = False,
    revision: str | None = None,
    trust_remote_code: bool | None = None,
    push_to_hub: str | None = None,
    private: bool = True,
) -> Path:
    """Write the export to ``out`` (see the module docstring); returns ``out``."""
    if dtype not in DTYPES and dtype != "auto":
        raise fail(f"--dtype {dtype}: choose one of auto, {', '.join(DTYPES)}")
    source = resolve(Path(src), which, base, revision=revision, trust_remote_code=trust_remote_code)
    if source.actor is None and not merge:
        raise fail(f"{src} is a full fine-tuning run: it has no adapter to export; pass --merge")
    out = Path(os.path.abspath(out))  # "." and "x/.." have a name and a parent to stage beside
    copied = _local([source.actor, source.critic])
    check_out(out, force, [*copied, *_local([source.checkpoint, source.base, source.tokenizer, src])], copied)
    tokenizer = _load_tokenizer(source)
    model = merged_model(source, dtype) if merge else None  # before anything is written
    try:
        with staged(out) as tmp:
            write_export(tmp, source, model, tokenizer)
    except OSError as err:
        raise fail(f"cannot write {out} ({one_line(err)}); it is unchanged: fix the cause and rerun") from err
    if model is not None:
        print(f"merged model ({str(model.dtype).removeprefix('torch.')}) -> {out}")
    else:
        print(f"actor adapter (base {source.base}) -> {out}")
    if source.critic is not None:
        print(f"critic adapter and value head (not merged) -> {out / CRITIC}")
    if push_to_hub:
        from huggingface_hub import HfApi

        api = HfApi()
        try:
            api.create_repo(push_to_hub, private=private, exist_ok=True)
            api.upload_folder(
                repo_id=push_to_hub, folder_path=str(out), commit_message="rlhf_lightning export"
            )
        except (OSError, ValueError) as err:  # Hub HTTP errors are OSErrors
            raise fail(
                f"{out} is written, but uploading it to {push_to_hub} failed ({one_line(err)}); log in "
                f"with `huggingface-cli login` and run `huggingface-cli upload {push_to_hub} {out}`"
            ) from err
        print(f"pushed {out} -> https://huggingface.co/{push_to_hub}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m rlhf_lightning.export",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("src", type=Path, help="a run directory or an adapter directory")
    ap.add_argument("--out", type=Path, required=True, help="the directory to write (new or empty)")
    ap.add_argument("--force", action="store_true", help="replace a non-empty --out's contents")
    ap.add_argument("--merge", action="store_true", help="fold the adapter into the base: a plain model")
    ap.add_argument(
        "--which", default="last", help="a run's adapters/checkpoint: last, best, step_000100, ..."
    )
    ap.add_argument(
        "--base", default=None, help="the base model (default: the run's model.path / the adapter's)"
    )
    ap.add_argument(
        "--revision", default=None, help="the base's Hub revision (default: the run's model.revision)"
    )
    ap.add_argument(
        "--trust-remote-code",
        action="store_true",
        default=None,
        help="run the base's own modelling code (default: the run's model.trust_remote_code)",
    )
    ap.add_argument(
        "--dtype",
        default="auto",
        help="merged weights' dtype: auto (the run's model.dtype, else the base's), float32, bfloat16, float16",
    )
    ap.add_argument("--push-to-hub", default=None, metavar="REPO", help="upload the export to this Hub repo")
    ap.add_argument(
        "--public", action="store_true", help="with --push-to-hub: a public repo (default private)"
    )
    args = ap.parse_args(argv)
    export(
        args.src,
        args.out,
        merge=args.merge,
        which=args.which,
        base=args.base,
        dtype=args.dtype,
        force=args.force,
        revision=args.revision,
        trust_remote_code=args.trust_remote_code,
        push_to_hub=args.push_to_hub,
        private=not args.public,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
