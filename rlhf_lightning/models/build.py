"""Load a tokenizer and a causal LM from a local directory or the Hub, and wrap it as a policy."""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from rlhf_lightning.config.errors import ConfigError, is_hub_id
from rlhf_lightning.models.adapters import (
    ACTOR,
    CRITIC,
    REFERENCE,
    adapter_dir,
    copy_adapter,
    load_into,
    load_value_head,
)
from rlhf_lightning.models.kernels import apply_liger, quantized_load_kwargs
from rlhf_lightning.models.policy import Policy

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Any one of these makes a directory a tokenizer directory (fast, SentencePiece, BPE, WordPiece).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
)
MIN_VOCAB = 16  # fewer tokens: transformers built a placeholder, not the model's tokenizer


def _hub_hint(path: str, err: Exception) -> RuntimeError:
    return RuntimeError(
        f"could not load {path!r} from the Hugging Face Hub ({type(err).__name__}: {err}). "
        "Without Hub access, download it elsewhere and pass a local directory: "
        "model=local model.path=/path/to/model"
    )


def _tokenizer_hint(field: str) -> str:
    tail = "" if field == "model.tokenizer_path" else ", or pass model.tokenizer_path=/path/to/tokenizer"
    return f"save the model's tokenizer there (tokenizer.save_pretrained(dir)){tail}"


def check_tokenizer_files(path: str, field: str) -> None:
    """A local directory must hold tokenizer files: without them transformers quietly builds a
    one-token tokenizer, and generation fails much later with an IndexError."""
    p = Path(path).expanduser()
    if p.is_dir() and not any((p / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(
            field,
            path,
            f"the directory has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); "
            + _tokenizer_hint(field),
        )


def _config_vocab_size(path: str) -> int | None:
    """``vocab_size`` from a local model directory's ``config.json`` (or its ``text_config``)."""
    config = Path(path).expanduser() / "config.json"
    if not config.is_file():
        return None
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # loading the model reports a broken config.json
    if not isinstance(data, dict):
        return None
    size = data.get("vocab_size") or (data.get("text_config") or {}).get("vocab_size")
    return size if isinstance(size, int) else None


def check_vocab(tok: PreTrainedTokenizerBase, path: str, field: str) -> None:
    """Refuse a degenerate tokenizer: a handful of tokens, or under half the model's vocabulary."""
    n, model_vocab = len(tok), _config_vocab_size(path)
    if n >= MIN_VOCAB and (model_vocab is None or 2 * n >= model_vocab):
        return
    of_model = f" for a model with {model_vocab} embeddings" if model_vocab else ""
    raise ConfigError(
        field,
        path,
        f"the tokenizer loaded from it has only {n} tokens{of_model}: its tokenizer files are "
        f"missing or incomplete; {_tokenizer_hint(field)}",
    )


def read_chat_template(value: str) -> str:
    """``model.chat_template``: a Jinja template, or the path of a ``.jinja`` file holding one."""
    if value.strip().endswith(".jinja"):
        path = Path(value.strip()).expanduser()
        if not path.is_file():
            raise ConfigError(
                "model.chat_template", value, "an existing .jinja file, or a Jinja template string"
            )
        return path.read_text(encoding="utf-8")
    return value


def load_tokenizer(
    path: str,
    *,
    revision: str | None = None,
    trust_remote_code: bool = False,
    pad_token: str | None = None,
    chat_template: str | None = None,
    need_chat_template: bool = True,
    field: str = "model.path",
) -> PreTrainedTokenizerBase:
    """Load a tokenizer; fail with a clear message when it is missing or degenerate, or lacks a
    pad token or chat template. ``field``: the config field that gave ``path``, for messages."""
    check_tokenizer_files(path, field)
    try:
        tok = AutoTokenizer.from_pretrained(path, revision=revision, trust_remote_code=trust_remote_code)
    except OSError as err:
        if is_hub_id(path):
            raise _hub_hint(path, err) from err
        raise
    check_vocab(tok, path, field)
    if pad_token is not None:
        tok.pad_token = pad_token
    if chat_template is not None:
        tok.chat_template = read_chat_template(chat_template)
    if tok.pad_token_id is None:
        raise ConfigError(
            "model.pad_token",
            None,
            f"the tokenizer at {path!r} has no pad token; set model.pad_token to one of its tokens "
            f"(its eos token is {tok.eos_token!r})",
        )
    if need_chat_template and not getattr(tok, "chat_template", None):
        raise ConfigError(
            "model.chat_template",
            None,
            f"the tokenizer at {path!r} has no chat template; set model.chat_template to a Jinja "
            "template, or env.apply_chat_template=false to feed raw prompts (base models)",
        )
    if tok.eos_token_id is None:
        raise ConfigError("tokenizer eos_token", None, f"the tokenizer at {path!r} has no eos token")
    return tok


def load_model(
    path: str,
    *,
    dtype: str = "auto",
    attn_implementation: str | None = None,
    revision: str | None = None,
    trust_remote_code: bool = False,
    quantization: str | None = None,
    quant_type: str = "nf4",
    double_quant: bool = True,
    compute_dtype: str = "bfloat16",
    liger_kernels: bool = False,
) -> PreTrainedModel:
    """The causal LM at ``path``; ``quantization`` (4bit, 8bit: QLoRA's frozen base, on this
    rank's GPU) and ``liger_kernels`` need CUDA (see ``models/kernels.py``)."""
    kwargs: dict[str, Any] = {"revision": revision, "trust_remote_code": trust_remote_code}
    kwargs["dtype"] = "auto" if dtype == "auto" else DTYPES[dtype]
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if quantization is not None:
        kwargs.update(quantized_load_kwargs(quantization, quant_type, double_quant, DTYPES[compute_dtype]))
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except OSError as err:
        if is_hub_id(path):
            raise _hub_hint(path, err) from err
        raise
    if liger_kernels:
        apply_liger(model)
    return model.train()  # from_pretrained returns eval mode


def disable_dropout(model: torch.nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    for key in ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
        if isinstance(getattr(model.config, key, None), float):
            setattr(model.config, key, 0.0)


def build_policy(
    model: PreTrainedModel,
    *,
    finetune: str = "lora",
    lora_r: int = 16,
    lora_alpha: int = 32,
    lora_dropout: float = 0.0,
    lora_target_modules: Any = "all-linear",
    need_reference: bool = False,
    gradient_checkpointing: bool = False,
    adapter_path: str | None = None,
    reference_from_checkpoint: bool = False,
    separate_reference: bool = False,
    with_critic: bool = False,
) -> Policy:
    """Wrap ``model`` as a trainable policy.

    ``finetune="lora"``: the base is frozen and an ``actor`` LoRA adapter is trained. The
    reference policy is the base with adapters disabled (free), or, with ``separate_reference``
    or when starting from ``adapter_path``, a frozen ``reference`` adapter. ``with_critic`` adds
    a trainable ``critic`` adapter and a scalar value head (PPO).

    ``adapter_path`` (a directory with ``actor/`` and optionally ``reference/`` and
    ``critic/``, as exported next to every checkpoint, or a single adapter directory) starts
    the actor from a saved adapter, and the loaded actor is copied onto the reference: each
    stage of an SFT -> DPO -> RL chain is regularised towards where it started. With
    ``reference_from_checkpoint`` a saved ``reference/`` is loaded instead (when present). A
    saved ``critic/`` (and its value head) is loaded when the algorithm has a critic.

    ``finetune="full"``: every weight trains; a frozen copy is kept as the reference only when
    ``need_reference``. Dropout is switched off everywhere: the log-probs of the update must be
    those of the policy that sampled (and the reference must be deterministic).
    """
    disable_dropout(model)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    share = not gradient_checkpointing
    if finetune != "lora":
        if adapter_path or with_critic or separate_reference:
            raise ConfigError(
                "model.finetune",
                finetune,
                "lora: adapter_path, a critic and a separate reference adapter are LoRA adapters on the frozen base",
            )
        return _full_policy(model, need_reference, share)
    for p in model.parameters():
        p.requires_grad_(False)
    check_lora_targets(model, lora_target_modules)
    config = _lora_config(lora_r, lora_alpha, lora_dropout, lora_target_modules)
    return _peft_policy(
        model,
        config,
        share=share,
        gradient_checkpointing=gradient_checkpointing,
        adapter_path=adapter_path,
        reference_from_checkpoint=reference_from_checkpoint,
        separate_reference=separate_reference,
        with_critic=with_critic,
    )


def _peft_policy(
    model: PreTrainedModel,
    config: LoraConfig,
    *,
    share: bool,
    gradient_checkpointing: bool,
    adapter_path: str | None,
    reference_from_checkpoint: bool,
    separate_reference: bool,
    with_critic: bool,
) -> Policy:
    """LoRA on the frozen ``model``: the ``actor`` adapter (loaded from ``adapter_path``), the
    ``reference`` and ``critic`` adapters when asked for; only the actor and critic train."""
    peft_model = get_peft_model(model, config, adapter_name=ACTOR)
    if adapter_path is not None:
        _load_actor(peft_model, adapter_path)
    reference_adapter = None
    if separate_reference or adapter_path is not None:
        _add_reference(peft_model, config, adapter_path, reference_from_checkpoint)
        reference_adapter = REFERENCE
    value_head = _add_critic(peft_model, model, config, adapter_path) if with_critic else None
    peft_model.set_adapter(ACTOR)
    for name, p in peft_model.named_parameters():  # actor and critic train; base and reference stay frozen
        p.requires_grad_(f".{ACTOR}." in name or f".{CRITIC}." in name)
    if gradient_checkpointing:
        peft_model.enable_input_require_grads()
    return Policy(
        peft_model,
        adapter_name=ACTOR,
        share_prompt=share,
        reference_adapter=reference_adapter,
        critic_adapter=CRITIC if with_critic else None,
        value_head=value_head,
    )


def linear_module_names(model: torch.nn.Module) -> list[str]:
    """The distinct last names of ``model``'s linear layers (what ``target_modules`` matches)."""
    return sorted(
        {
            name.rsplit(".", 1)[-1]
            for name, m in model.named_modules()
            if name and (isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D")
        }
    )


def check_lora_targets(model: torch.nn.Module, target: Any) -> None:
    """Each name of a ``model.lora.target_modules`` list names modules of ``model`` (as PEFT
    matches them: the full name or its last parts); a name matching none is refused with the
    model's linear module names (PEFT refused only when no name matched, with no field named)."""
    if isinstance(target, str):  # all-linear, or a regex PEFT matches itself
        return
    target = [str(t) for t in target]  # a list, or Hydra's ListConfig
    names = [n for n, _ in model.named_modules() if n]
    missing = [t for t in target if not any(n == t or n.endswith(f".{t}") for n in names)]
    if missing:
        raise ConfigError(
            "model.lora.target_modules",
            target,
            f"names of the model's modules: {', '.join(missing)} match none; its linear modules are "
            f"{', '.join(linear_module_names(model))} (or all-linear)",
        )


def _full_policy(model: PreTrainedModel, need_reference: bool, share: bool) -> Policy:
    """Full fine-tuning: every weight of ``model`` trains; a frozen deep copy is the reference
    when ``need_reference`` (no adapters to disable)."""
    reference = None
    if need_reference:
        reference = copy.deepcopy(model)
        for p in reference.parameters():
            p.requires_grad_(False)
    return Policy(model, adapter_name=None, reference=reference, share_prompt=share)


def _lora_config(r: int, alpha: int, dropout: float, target_modules: Any) -> LoraConfig:
    """The one LoRA config of every adapter (actor, reference, critic); ``target_modules`` a
    name like ``all-linear`` or a list of module names (a Hydra ListConfig becomes a list)."""
    target = list(target_modules) if not isinstance(target_modules, str) else target_modules
    return LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=target,
        task_type="CAUSAL_LM",
    )


def _load_actor(peft_model: PeftModel, adapter_path: str) -> None:
    """Load the saved actor of ``adapter_path`` (``actor/`` or a bare adapter) into the actor slot."""
    loaded = adapter_dir(adapter_path, ACTOR)
    if loaded is None:
        raise ConfigError(
            "model.adapter_path",
            adapter_path,
            "a directory holding actor/adapter_config.json (or adapter_config.json)",
        )
    load_into(peft_model, loaded, ACTOR)
    log.info("actor adapter loaded from %s", loaded)


def _add_reference(
    peft_model: PeftModel, config: LoraConfig, adapter_path: str | None, reference_from_checkpoint: bool
) -> None:
    """Add the frozen ``reference`` adapter: the saved ``reference/`` of ``adapter_path`` with
    ``reference_from_checkpoint`` (when present), else a copy of the actor as it starts."""
    peft_model.add_adapter(REFERENCE, config)
    saved_ref = adapter_dir(adapter_path, REFERENCE) if adapter_path and reference_from_checkpoint else None
    if saved_ref is not None:
        load_into(peft_model, saved_ref, REFERENCE)
    else:
        copy_adapter(peft_model, ACTOR, REFERENCE)


def _add_critic(
    peft_model: PeftModel, model: PreTrainedModel, config: LoraConfig, adapter_path: str | None
) -> torch.nn.Linear:
    """Add the ``critic`` adapter and its scalar value head (zero-initialised: values start at 0),
    both loaded from the saved ``critic/`` of ``adapter_path`` when there is one (PPO)."""
    peft_model.add_adapter(CRITIC, config)
    hidden = model.config.hidden_size
    # The output layer's dtype: a quantised base's first parameters may be packed integers.
    value_head = torch.nn.Linear(hidden, 1, dtype=model.get_output_embeddings().weight.dtype)
    torch.nn.init.zeros_(value_head.weight)
    torch.nn.init.zeros_(value_head.bias)
    saved_critic = adapter_dir(adapter_path, CRITIC) if adapter_path is not None else None
    if saved_critic is not None:
        load_into(peft_model, saved_critic, CRITIC)
        load_value_head(value_head, saved_critic)
    return value_head
