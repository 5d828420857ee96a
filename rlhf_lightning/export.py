"""Export a run's policy for serving: ``python -m rlhf_lightning.export SRC --out DIR [--merge]``.

``SRC`` is a run directory (``outputs/<name>/<time>``: its ``config.yaml`` names the base model
and tokenizer, ``checkpoints/adapters/<which>`` holds the adapters) or an adapter directory
(``actor/``, ``critic/``, or a bare PEFT adapter; the base comes from its
``adapter_config.json`` or ``--base``).

- Without ``--merge``: ``DIR`` is the actor's PEFT adapter with the tokenizer and chat template
  (``PeftModel.from_pretrained(base, DIR)``; vLLM serves it with ``--enable-lora``).
- With ``--merge``: ``DIR`` is a plain transformers model, the adapter folded into the base
  weights, with the tokenizer and chat template (``AutoModelForCausalLM.from_pretrained(DIR)``,
  ``vllm serve DIR``). A full fine-tuning run is exported this way from its last checkpoint.
- PPO's critic (adapter + ``value_head.safetensors``) is copied to ``DIR/critic``, never merged.
- ``--push-to-hub REPO`` uploads ``DIR`` to the Hugging Face Hub (``huggingface-cli login`` first).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from transformers import PreTrainedModel

from rlhf_lightning.models.adapters import ACTOR, CRITIC, adapter_dir
from rlhf_lightning.models.build import DTYPES, load_model, load_tokenizer


@dataclass
class Source:
    """What an export reads: the base model, its tokenizer settings, the adapters or checkpoint."""

    base: str
    tokenizer: str
    tokenizer_kwargs: dict[str, Any]
    actor: Path | None  # the actor adapter (None: full fine-tuning)
    critic: Path | None
    checkpoint: Path | None = None  # full fine-tuning: the Lightning checkpoint with the weights


def resolve(src: Path, which: str = "last", base: str | None = None) -> Source:
    """Read ``src`` (a run directory or an adapter directory) into a :class:`Source`."""
    if not src.is_dir():
        raise SystemExit(f"error: {src} is not a directory (give a run directory or an adapter directory)")
    tokenizer: str | None = None
    if (src / "config.yaml").is_file():
        from omegaconf import OmegaConf

        cfg = OmegaConf.load(src / "config.yaml")
        m = cfg.model
        base_path = base or str(m.path)
        tokenizer_kwargs = {
            "revision": m.get("revision"),
            "pad_token": m.get("pad_token"),
            "chat_template": m.get("chat_template"),
            "need_chat_template": False,
        }
        tokenizer = m.get("tokenizer_path") or base_path
        if m.finetune == "full":
            ckpt = src / "checkpoints" / f"{which}.ckpt"
            if not ckpt.is_file():
                raise SystemExit(f"error: a full fine-tuning run exports from {ckpt}, which does not exist")
            return Source(base_path, tokenizer, tokenizer_kwargs, None, None, ckpt)
        adapters = src / "checkpoints" / "adapters" / which
        if not adapters.is_dir():
            found = sorted(p.name for p in (src / "checkpoints" / "adapters").glob("*") if p.is_dir())
            raise SystemExit(
                f"error: no adapters {adapters}; choose --which among {found or 'none (no checkpoint)'}"
            )
        src = adapters
    else:
        tokenizer_kwargs = {"need_chat_template": False}
        base_path = base or ""
    actor = adapter_dir(src, ACTOR)
    if actor is None:
        raise SystemExit(
            f"error: {src} holds no actor adapter (actor/adapter_config.json or adapter_config.json)"
        )
    if not base_path:
        base_path = (
            json.loads((actor / "adapter_config.json").read_text()).get("base_model_name_or_path") or ""
        )
        if not base_path:
            raise SystemExit("error: the adapter names no base model; pass --base PATH")
    return Source(base_path, tokenizer or base_path, tokenizer_kwargs, actor, adapter_dir(src, CRITIC))


def merged_model(source: Source, dtype: str = "auto") -> PreTrainedModel:
    """The base with the actor adapter folded in (or a full fine-tuning checkpoint's weights)."""
    model = load_model(source.base, dtype=dtype).eval()
    if source.checkpoint is not None:
        state = torch.load(source.checkpoint, map_location="cpu", weights_only=False)["state_dict"]
        prefix = "policy.model."
        weights = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
        missing, unexpected = model.load_state_dict(weights, strict=False)
        tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
        if set(missing) - tied or unexpected:
            raise SystemExit(
                f"error: {source.checkpoint} does not match {source.base}: missing {sorted(missing)[:3]}, "
                f"unexpected {sorted(unexpected)[:3]}"
            )
        return model
    from peft import PeftModel

    peft = PeftModel.from_pretrained(model, str(source.actor))
    return cast(PreTrainedModel, peft.merge_and_unload())


def export(
    src: Path,
    out: Path,
    *,
    merge: bool = False,
    which: str = "last",
    base: str | None = None,
    dtype: str = "auto",
    push_to_hub: str | None = None,
    private: bool = True,
) -> Path:
    """Write the export to ``out`` (see the module docstring); returns ``out``."""
    source = resolve(Path(src), which, base)
    if source.actor is None and not merge:
        raise SystemExit("error: a full fine-tuning run has no adapter to export; pass --merge")
    if dtype not in DTYPES and dtype != "auto":
        raise SystemExit(f"error: --dtype {dtype}: one of auto, {', '.join(DTYPES)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(source.tokenizer, **source.tokenizer_kwargs)
    if merge:
        model = merged_model(source, dtype)
        model.save_pretrained(out)  # config, generation config, safetensors weights
        print(f"merged model -> {out}")
    else:
        assert source.actor is not None
        for f in source.actor.iterdir():
            if f.is_file():
                shutil.copy2(f, out / f.name)
        print(f"actor adapter (base {source.base}) -> {out}")
    tokenizer.save_pretrained(out)  # with the chat template the run used
    if source.critic is not None:
        shutil.copytree(source.critic, out / CRITIC, dirs_exist_ok=True)
        print(f"critic adapter and value head (not merged) -> {out / CRITIC}")
    if push_to_hub:
        from huggingface_hub import HfApi

        api = HfApi()
        api.create_repo(push_to_hub, private=private, exist_ok=True)
        api.upload_folder(repo_id=push_to_hub, folder_path=str(out), commit_message="rlhf_lightning export")
        print(f"pushed {out} -> https://huggingface.co/{push_to_hub}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m rlhf_lightning.export",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("src", type=Path, help="a run directory or an adapter directory")
    ap.add_argument("--out", type=Path, required=True, help="the directory to write")
    ap.add_argument("--merge", action="store_true", help="fold the adapter into the base: a plain model")
    ap.add_argument(
        "--which", default="last", help="a run's adapters/checkpoint: last, best, step_000100, ..."
    )
    ap.add_argument(
        "--base", default=None, help="the base model (default: the run's model.path / the adapter's)"
    )
    ap.add_argument("--dtype", default="auto", help="merged weights' dtype: auto, float32, bfloat16, float16")
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
        push_to_hub=args.push_to_hub,
        private=not args.public,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
