"""Build the embedded tool-using chat model (``model=tiny_tools``) from scratch, offline, with ``algo=sft``.

Design (why a new model rather than ``tiny_chat``): the tools chat template
(``rlhf_lightning/assets/chat_templates/tools.jinja``, Hermes/Qwen2.5 style) puts the calculator's
JSON schema in the system turn, which is ~488 tokens with ``tiny_chat``'s tokenizer (trained on
dialogues without it). A tokenizer trained on dialogues rendered *with* that template makes every
word of the system turn one token (186 tokens, the floor of Qwen2's pre-tokenizer, which keeps
``AutoTokenizer`` identical to ours and every digit its own token) and a calculator call ~29.

1. Generate tool-use SFT dialogues with ``make_tool_sft_data.tool_use_dialogues``: episodes of
   ``env=tools`` (``CalculatorToolEnv``, a real ``calculator(expression)`` tool, hermes calls,
   tool results in their own turn) played by a scripted policy of mixed quality (``--quality``:
   calls that are sometimes skipped, partial, malformed or copied wrong).
2. Train a byte-level BPE tokenizer on those dialogues rendered with ``tools.jinja`` and the
   env's tool schemas, make ``tools.jinja`` its chat template, and build a ~1M-parameter
   Qwen2-style model (``model=tiny``'s size, ``max_position_embeddings`` 1024 so that four turns
   fit) next to it: the transformer body of ``--init`` (default: the ``tiny_chat`` asset, which
   already plays ``tool_calc``) with its embeddings carried over token by token, new tokens
   starting as the mean of their pieces; ``--init none`` starts from random weights (two such
   builds here stayed at an SFT loss of ~0.73 with no success for 600-800 steps).
3. Supervised-fine-tune it with the package's SFT module (``algo=sft``, ``env=tools``: the chat
   formatter adds the tools system turn exactly as in RL; full fine-tuning; loss on assistant
   tokens only). Every ``--eval-every`` steps, play the env's eval split (greedy, and sampled at
   temperature 1; ``rollout.max_new_tokens`` 40) and stop once sampled success reaches
   ``--target`` and greedy success ``--target-greedy`` (partial: RL has room to improve it), or
   at ``--max-steps`` / ``--max-minutes``.
4. Save model, tokenizer and chat template to ``rlhf_lightning/assets/tiny_tools`` with
   ``build_info.json`` (steps, seconds, data success, eval success and turns per episode, the
   history of every evaluation, the arguments).

    OMP_NUM_THREADS=1 python scripts/build_tiny_tools_model.py     # stops at --target or --max-minutes
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, cast

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling scripts
import torch
from build_tiny_chat_model import QUIET_BUILD, ROOT, EvalEnvsAndStop, compose_config
from make_chat_sft_data import success_rates, write_jsonl
from make_tool_sft_data import DEFAULT_COPY_QUALITY, DEFAULT_QUALITY, ENV, ENV_KWARGS, tool_use_dialogues
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from rlhf_lightning.config import ASSETS
from rlhf_lightning.models.tiny import build_tiny_model, build_tokenizer
from rlhf_lightning.rollout.episodes.chat import env_tools
from rlhf_lightning.rollout.episodes.harness import RolloutHarness
from rlhf_lightning.run import run
from rlhf_lightning.run.factories import harness_from

TOOLS_MODEL_DIR = ASSETS / "tiny_tools"
TOOLS_TEMPLATE = ASSETS / "chat_templates" / "tools.jinja"
MAX_POSITIONS = 1024  # conf/env/tools.yaml's max_model_len
MAX_NEW_TOKENS = 40  # a call is ~29 tokens with this tokenizer, plus the end-of-turn token


def tools_harness(tokenizer: Any) -> RolloutHarness:
    """The rollout harness of ``conf/env/tools.yaml``, with the env's tools in the system turn,
    as a run builds it (``factories.harness_from``; an offline family: the env's own rewards)."""
    harness, _, _ = harness_from(compose_config([f"env={ENV}"]), tokenizer, online=False)
    return harness


def tools_tokenizer(dialogues: list[dict[str, Any]], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on ``dialogues`` rendered with ``tools.jinja`` and the env's tool
    schemas (the system turn included), with ``tools.jinja`` as its chat template."""
    template = TOOLS_TEMPLATE.read_text()
    tools = env_tools(tool_use_env)
    bootstrap = build_tokenizer(["x"], vocab_size=300)  # only to render the chat template
    bootstrap.chat_template = template
    corpus = [
        cast(str, bootstrap.apply_chat_template(d["messages"], tools=cast(Any, tools), tokenize=False))
        for d in dialogues
    ]
    tokenizer = build_tokenizer(corpus, vocab_size=vocab_size)
    tokenizer.chat_template = template
    return tokenizer


def tool_use_env() -> Any:
    from rlhf_lightning.envs.tool_tasks import CalculatorToolEnv

    return CalculatorToolEnv(**ENV_KWARGS)


def transferred_embeddings(
    tokenizer: PreTrainedTokenizerFast, source: PreTrainedTokenizerBase, source_embeddings: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """Input embeddings for ``tokenizer``'s vocabulary from a model with ``source``'s: a token
    that ``source`` has too (same byte-level string) keeps its row; any other token starts as
    the mean of the rows of its text as ``source`` encodes it. Both are byte-level BPEs over the
    same byte alphabet, so equal strings are equal tokens.

    Shapes: ``source_embeddings`` (V_source, H) -> (V, H). Returns them and how many rows were
    copied as they were.
    """
    source_vocab = source.get_vocab()
    rows, copied = [], 0
    for token, _ in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]):
        if token in source_vocab:
            rows.append(source_embeddings[source_vocab[token]])
            copied += 1
            continue
        text = tokenizer.convert_tokens_to_string([token])
        ids = source(text, add_special_tokens=False).input_ids
        rows.append(source_embeddings[ids].mean(0))
    return torch.stack(rows), copied  # (V, H)


def save_untrained_tools(
    tokenizer: PreTrainedTokenizerFast, directory: Path, init: Path | None = None
) -> None:
    """A tiny model sized to ``tokenizer``, with room for four turns, saved next to it: random
    weights, or (``init``: a model directory of the same architecture, e.g. tiny_chat) that
    model's transformer body with its embeddings carried over token by token
    (:func:`transferred_embeddings`)."""
    model = build_tiny_model(
        len(tokenizer),
        max_position_embeddings=MAX_POSITIONS,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    if init is not None:
        source = AutoModelForCausalLM.from_pretrained(init, dtype=torch.float32)
        state = {
            k: v for k, v in source.state_dict().items() if "embed_tokens" not in k and "lm_head" not in k
        }
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected and all("embed_tokens" in k or "lm_head" in k for k in missing), missing
        embeddings, copied = transferred_embeddings(
            tokenizer, AutoTokenizer.from_pretrained(init), source.get_input_embeddings().weight.detach()
        )
        with torch.no_grad():
            model.get_input_embeddings().weight.copy_(embeddings)  # tied: the output head too
        print(f"initialised from {init}: {copied} of {len(tokenizer)} token rows copied", flush=True)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    print(f"vocab {len(tokenizer)}, parameters {sum(p.numel() for p in model.parameters()):,}", flush=True)


def sft_overrides(base: Path, work: Path, args: argparse.Namespace) -> list[str]:
    """``algo=sft`` on the dialogues, full fine-tuning of the untrained model, env=tools."""
    return [
        "algo=sft",
        "model=local",
        f"model.path={base}",
        "model.finetune=full",
        "model.dtype=float32",
        "model.attn_implementation=eager",
        f"algo.data_path={work / 'train.jsonl'}",
        f"algo.eval_data_path={work / 'eval.jsonl'}",
        "algo.env_eval=false",
        f"algo.lr={args.lr}",
        "algo.warmup_steps=50",
        "algo.min_lr_ratio=1.0",
        f"algo.batch_size={args.batch_size}",
        f"trainer.max_steps={args.max_steps}",
        f"trainer.val_check_interval={args.eval_every}",
        f"env={ENV}",
        f"rollout.max_new_tokens={MAX_NEW_TOKENS}",
        *QUIET_BUILD,
        f"seed={args.seed}",
        "num_threads=1",
        f"output_dir={work / 'run'}",
    ]


class EvalAndStopWithGreedy(EvalEnvsAndStop):
    """:class:`EvalEnvsAndStop` that stops once sampled success reaches ``target`` *and* greedy
    success reaches ``target_greedy``: a model that copies expressions and results well when it
    follows its best move, and still samples its mistakes (RL's room)."""

    def __init__(self, *args: Any, target_greedy: float = 0.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.target_greedy = target_greedy

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        loss = trainer.callback_metrics.get("eval/loss")
        if loss is not None:
            self.history[-1]["eval_loss"] = round(float(loss), 4)
        last = self.history[-1][ENV]
        done = last["success_sampled"] >= self.target and last["success_greedy"] >= self.target_greedy
        if trainer.state.fn == "fit" and done:
            trainer.should_stop = True


def shown_path(path: Path) -> str:
    """``path`` relative to the repository when it is inside it (e.g. the tiny_chat asset)."""
    full = path.resolve()
    return str(full.relative_to(ROOT)) if full.is_relative_to(ROOT) else str(full)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=TOOLS_MODEL_DIR)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--dialogues", type=int, default=20_000)
    ap.add_argument("--quality", type=float, default=DEFAULT_QUALITY, help="the scripted policy's")
    ap.add_argument(
        "--copy-quality", type=float, default=DEFAULT_COPY_QUALITY, help="its final-answer copies"
    )
    ap.add_argument("--target", type=float, default=0.1, help="stop once sampled success >= this")
    ap.add_argument("--target-greedy", type=float, default=0.3, help="... and greedy success >= this")
    ap.add_argument("--max-steps", type=int, default=3000)
    ap.add_argument("--max-minutes", type=float, default=32.0, help="stop (at a step end) after this long")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-rows", type=int, default=100, help="eval episodes per mode")
    ap.add_argument(
        "--init",
        type=Path,
        default=ASSETS / "tiny_chat",
        help="start from this model's body and carry its embeddings over (--init none: random weights)",
    )
    ap.add_argument("--vocab-size", type=int, default=1024, help="an upper bound: merges run out near 600")
    args = ap.parse_args()
    if str(args.init).lower() == "none":
        args.init = None
    t0 = time.time()
    work = Path(tempfile.mkdtemp(prefix="tiny_tools_build_"))
    try:
        # 1. Dialogues: train rows 0.., held-out train rows after them (the SFT eval loss).
        quality = {"quality": args.quality, "copy_quality": args.copy_quality}
        train = tool_use_dialogues(args.dialogues, seed=args.seed, **quality)
        held_out = tool_use_dialogues(100, seed=args.seed, first_row=args.dialogues, **quality)
        write_jsonl(train, work / "train.jsonl")
        write_jsonl(held_out, work / "eval.jsonl")
        print(f"data success: {success_rates(train)}", flush=True)
        # 2. Tokenizer trained on the dialogues as the model sees them (system turn with the tools).
        tokenizer = tools_tokenizer(train[:8000], args.vocab_size)
        base = work / "base"
        save_untrained_tools(tokenizer, base, args.init)
        # 3. SFT with algo=sft; the env is played by the callback, not the module.
        cfg = compose_config(sft_overrides(base, work, args))
        stop = EvalAndStopWithGreedy(
            {ENV: tools_harness(tokenizer)},
            args.eval_rows,
            args.target,
            args.max_minutes * 60,
            target_greedy=args.target_greedy,
        )
        result = run(cfg, extra_callbacks=[stop])
        final = stop.history[-1]
        # 4. Save (into a temporary sibling, then in place of the old directory).
        staging = args.out.with_name(args.out.name + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        result.module.policy.model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        info = {
            "seed": args.seed,
            "sft_steps": result.trainer.global_step,
            "seconds": round(time.time() - t0),
            "data": {
                "dialogues": args.dialogues,
                **quality,
                "success": success_rates(train)[ENV],
            },
            "vocab_size": len(tokenizer),
            "init": None if args.init is None else shown_path(args.init),
            "args": {k: str(v) for k, v in vars(args).items()},
            "eval": final[ENV],
            "eval_rows": args.eval_rows,
            "max_new_tokens": MAX_NEW_TOKENS,
            "built_with": "scripts/build_tiny_tools_model.py (algo=sft, env=tools)",
            "history": stop.history,
        }
        (staging / "build_info.json").write_text(json.dumps(info, indent=1))
        shutil.rmtree(args.out, ignore_errors=True)
        staging.rename(args.out)
        print(f"saved to {args.out} after {info['sft_steps']} SFT steps ({info['seconds']}s): {info['eval']}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
