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
  (which loading would execute) is refused. The base's own code (``auto_map``) runs only with
  ``--trust-remote-code``, never because the run's ``config.yaml`` asks for it.
- ``--push-to-hub REPO`` uploads ``DIR`` to the Hugging Face Hub (``huggingface-cli login`` first).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.export.files import check_out, staged, write_export
from rlhf_lightning.export.merge import merged_model
from rlhf_lightning.export.source import Source, fail, one_line, remote_code_hint, resolve
from rlhf_lightning.models.adapters import CRITIC
from rlhf_lightning.models.build import DTYPES, load_tokenizer


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
            f"local copy of the run's model and its tokenizer{remote_code_hint(source)}"
        ) from err


def _local(paths: list[str | Path | None]) -> list[Path]:
    """The paths among ``paths`` that exist here (a Hub id does not)."""
    return [Path(p) for p in paths if p is not None and Path(p).exists()]


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
    if source.run_trust_remote_code and not source.trust_remote_code:
        print(
            f"note: {src} was trained with model.trust_remote_code=true; export runs none of the base's "
            "own code unless you pass --trust-remote-code",
            file=sys.stderr,
        )
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
        help="run the base's own modelling and tokenizer code (never by default, whatever the run's "
        "model.trust_remote_code says: a run directory may come from anyone)",
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
