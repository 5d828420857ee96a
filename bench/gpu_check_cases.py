"""The checks of ``bench/gpu_check.py``, one function each; every one runs in its own process on
a CUDA device and returns ``(status, result, details)``: status ``pass``, ``fail`` or ``info``
(a measurement without a threshold), result one line for the table, details the numbers.

Only the public API of the project is called (the policy, the ops, ``run(cfg)``): these are
what a user's GPU run executes.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MB = 2**20
DEVICE = "cuda"  # a smoke run of the code paths may set "cpu" (and smaller sizes below)
LIGER_SHAPE = (8, 1024)  # (B, T) of the Liger comparison
# Qwen2.5-0.5B's sizes (its config.json), built with random weights: nothing is downloaded.
QWEN_0P5B = dict(
    vocab_size=151_936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32_768,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)

Result = tuple[str, str, dict[str, Any]]


def _torch() -> Any:
    import torch

    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    return torch


def peak_mb(torch: Any, fn: Any) -> tuple[Any, float, float]:
    """``fn()``'s result, its peak CUDA memory above what was allocated before (MiB) and seconds."""
    if DEVICE != "cuda":
        t0 = time.perf_counter()
        return fn(), 0.0, time.perf_counter() - t0
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, (torch.cuda.max_memory_allocated() - base) / MB, time.perf_counter() - t0


def allocated(torch: Any) -> int:
    """CUDA memory allocated now (0 on a CPU smoke run)."""
    if DEVICE != "cuda":
        return 0
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return int(torch.cuda.memory_allocated())


def qwen(torch: Any, attn: str, dtype: Any, **sizes: Any) -> Any:
    """A Qwen2 causal LM with random weights on the GPU (``sizes`` override Qwen2.5-0.5B's)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**{**QWEN_0P5B, **sizes})
    with torch.device(DEVICE):
        model = Qwen2ForCausalLM._from_config(config, attn_implementation=attn, dtype=dtype)
    return model.train()


def lora_policy(torch: Any, model: Any, r: int = 16) -> Any:
    """The project's LoRA policy over ``model``, with non-zero adapters (so they matter)."""
    from rlhf_lightning.models.build import build_policy

    policy = build_policy(model, finetune="lora", lora_r=r, lora_alpha=2 * r)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    return policy


# ---------------------------------------------------------------- (a) flash attention, packed rows
SEGMENTS = [[300, 200, 500], [1000], [400, 250, 350]]  # 3 rows of 3, 1 and 3 packed sequences


def flash_packed() -> Result:
    """A 3-row packed batch through ``Policy.token_logprobs`` under flash_attention_2 against each
    sequence alone under sdpa (transformers separates packed sequences by positions only in a
    one-row batch; the policy must not let several rows attend across their sequences)."""
    torch = _torch()
    from rlhf_lightning.records.trajectory import segment_positions

    # larger random weights than HF's init: peaked predictions, so attention mistakes show
    small = dict(
        vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=4, initializer_range=0.1
    )
    model = qwen(torch, "flash_attention_2", torch.bfloat16, num_attention_heads=8, **small)
    policy = lora_policy(torch, model, r=8)
    g = torch.Generator().manual_seed(0)
    width = max(sum(s) for s in SEGMENTS) + 8
    ids = torch.zeros(len(SEGMENTS), width, dtype=torch.long)
    mask, action = torch.zeros_like(ids), torch.zeros(len(SEGMENTS), width - 1, dtype=torch.bool)
    sequences = []
    for row, lens in enumerate(SEGMENTS):
        at = 0
        for n in lens:
            seq = torch.randint(3, model.config.vocab_size, (n,), generator=g)
            ids[row, at : at + n], mask[row, at : at + n] = seq, 1
            action[row, at + n // 4 : at + n - 1] = True  # the last 3/4 of each sequence are actions
            sequences.append((seq, n // 4))
            at += n
    pos = segment_positions(SEGMENTS, width)
    ids, mask, action, pos = (t.to(DEVICE) for t in (ids, mask, action, pos))
    with torch.no_grad():
        flash, _ = policy.token_logprobs(ids, mask, action, position_ids=pos)
        flash = flash[action].float()
        # what the model alone does with several packed rows (the defect the policy must avoid)
        logits = policy.causal_lm(input_ids=ids, position_ids=pos).logits[:, :-1].float()
        mixed = logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)[action]
        del logits
        lm = policy.causal_lm
        if hasattr(lm, "set_attn_implementation"):
            lm.set_attn_implementation("sdpa")
        else:
            lm.config._attn_implementation = "sdpa"
        alone = []
        for seq, start in sequences:
            one = seq[None].to(DEVICE)
            act = torch.zeros(1, len(seq) - 1, dtype=torch.bool, device=DEVICE)
            act[0, start : len(seq) - 1] = True
            lp, _ = policy.token_logprobs(one, torch.ones_like(one), act)
            alone.append(lp[act].float())
        expected = torch.cat(alone)
    diff = float((flash - expected).abs().max())
    defect = float((mixed - expected).abs().max())
    tol = 0.05  # bf16 bodies, two kernels
    status = "pass" if diff < tol < defect else ("fail" if diff >= tol else "info")
    line = (
        f"max |logp diff| {diff:.4f} (tolerance {tol}, bf16); rows attending across sequences "
        f"would differ by {defect:.3f}" + ("" if defect > tol else " (too little to tell: inconclusive)")
    )
    return status, line, {"max_abs_diff": diff, "mixed_rows_diff": defect, "tokens": int(action.sum())}


# ---------------------------------------------------------------- (b) Liger fused loss vs ours
def liger_vs_ours() -> Result:
    """The GRPO loss and its gradients through Liger's fused linear loss (``ops/liger.py``) against
    our chunked log-prob op + objective + aggregation (``ops/logprobs.py``), at Qwen2.5-0.5B's
    head sizes (V=151,936, H=896) on 8 x 1024 tokens, bf16; and each path's peak memory."""
    torch = _torch()
    from rlhf_lightning.losses import aggregate, get_policy_loss
    from rlhf_lightning.ops import chunked_logprobs
    from rlhf_lightning.ops.liger import LigerLoss, liger_policy_loss

    (b, t), hdim, vocab = LIGER_SHAPE, QWEN_0P5B["hidden_size"], QWEN_0P5B["vocab_size"]
    action = torch.ones(b, t, dtype=torch.bool, device=DEVICE)
    action[:, :64] = False  # a prompt
    n = int(action.sum())
    rows = (torch.randn(n, hdim, device=DEVICE) * 0.5).bfloat16().requires_grad_(True)
    head = torch.nn.Linear(hdim, vocab, bias=False, device=DEVICE, dtype=torch.bfloat16)
    targets = torch.randint(0, vocab, (n,), device=DEVICE)
    adv = torch.randn(b, device=DEVICE)
    with torch.no_grad():
        cur = torch.zeros(b, t, device=DEVICE).masked_scatter(
            action, chunked_logprobs(rows, head.weight, targets)
        )
    old = (cur + torch.randn(b, t, device=DEVICE) * 0.1) * action
    norm = {"num_tokens": action.sum().float(), "num_seqs": torch.tensor(float(b), device=DEVICE)}

    def ours() -> tuple[Any, ...]:
        logp = torch.zeros(b, t, device=DEVICE).masked_scatter(
            action, chunked_logprobs(rows, head.weight, targets)
        )
        per_token, _ = get_policy_loss("ppo_clip")(logp, old, adv, action, clip_low=0.2, clip_high=0.28)
        loss = aggregate(per_token, action, "token_mean", max_len=t, **norm)
        return (loss.detach(), *torch.autograd.grad(loss, [rows, head.weight]))

    def liger() -> tuple[Any, ...]:
        objective = LigerLoss("ppo_clip", "token_mean", 0.2, 0.28)
        loss, _ = liger_policy_loss(
            rows, head, targets, action, adv, old, None, None, objective,
            temperature=1.0, max_len=t, compiled=DEVICE == "cuda", **norm,
        )  # fmt: skip
        return (loss.detach(), *torch.autograd.grad(loss, [rows, head.weight]))

    liger()  # compile once, outside the measurement
    (l_ours, gh_o, gw_o), mem_ours, s_ours = peak_mb(torch, ours)
    (l_liger, gh_l, gw_l), mem_liger, s_liger = peak_mb(torch, liger)

    def rel(a: Any, b_: Any) -> float:
        return float((a.float() - b_.float()).abs().max() / b_.float().abs().max().clamp(min=1e-12))

    d = {
        "loss_ours": float(l_ours),
        "loss_liger": float(l_liger),
        "loss_abs_diff": float((l_ours - l_liger).abs()),
        "grad_rows_rel_diff": rel(gh_l, gh_o),
        "grad_head_rel_diff": rel(gw_l, gw_o),
        "peak_mb_ours": mem_ours,
        "peak_mb_liger": mem_liger,
        "time_s_ours": s_ours,
        "time_s_liger": s_liger,
    }
    ok = (
        d["loss_abs_diff"] < 1e-3 * max(1.0, abs(d["loss_ours"]))
        and max(d["grad_rows_rel_diff"], d["grad_head_rel_diff"]) < 0.02
    )
    line = (
        f"loss diff {d['loss_abs_diff']:.2e}, grad rel diff {max(d['grad_rows_rel_diff'], d['grad_head_rel_diff']):.2e}; "
        f"peak {mem_ours:.0f} MiB ours vs {mem_liger:.0f} MiB Liger"
    )
    return ("pass" if ok else "fail"), line, d


# ---------------------------------------------------------------- (c) QLoRA 4-bit vs bf16 LoRA
def qlora_memory() -> Result:
    """Peak memory of a LoRA forward + backward over 4 x 1024 tokens on a Qwen2.5-0.5B-shaped base,
    loaded in bf16 and in 4-bit (nf4, the project's ``load_model(quantization="4bit")``)."""
    torch = _torch()
    from rlhf_lightning.models.build import load_model

    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        base = qwen(torch, "sdpa", torch.bfloat16)
        base.save_pretrained(tmp)
        del base
        for name, quant in (("bf16", None), ("4bit", "4bit")):
            before = allocated(torch)
            model = load_model(tmp, dtype="bfloat16", attn_implementation="sdpa", quantization=quant)
            if quant is None:  # a quantised model is placed on the GPU by its device_map
                model = model.to(DEVICE)
            weights = (allocated(torch) - before) / MB
            policy = lora_policy(torch, model)
            ids = torch.randint(3, QWEN_0P5B["vocab_size"], (4, 1024), device=DEVICE)
            action = torch.ones(4, 1023, dtype=torch.bool, device=DEVICE)

            def step(p: Any = policy, i: Any = ids, a: Any = action) -> None:
                lp, _ = p.token_logprobs(i, torch.ones_like(i), a)
                lp[a].mean().backward()

            _, peak, secs = peak_mb(torch, step)
            out[name] = {"weights_mb": weights, "step_peak_mb": peak, "step_s": secs}
            del policy, model, step
    line = (
        f"weights {out['bf16']['weights_mb']:.0f} -> {out['4bit']['weights_mb']:.0f} MiB; step peak "
        f"{out['bf16']['step_peak_mb']:.0f} -> {out['4bit']['step_peak_mb']:.0f} MiB (bf16 -> 4-bit)"
    )
    smaller = out["4bit"]["weights_mb"] < out["bf16"]["weights_mb"]
    return ("pass" if smaller else "fail"), line, out


# ---------------------------------------------------------------- (d) DeepSpeed through run(cfg)
def deepspeed_run(stage: int) -> Result:
    """Three GRPO steps of the tiny model through ``run(cfg)`` with ``strategy=deepspeed_zero<stage>``:
    the run finishes, the LoRA adapters moved, ``last.ckpt`` is a single Lightning file."""
    return three_steps([f"strategy=deepspeed_zero{stage}", "trainer.accelerator=gpu", "trainer.devices=1"])


def three_steps(strategy: list[str]) -> Result:
    """Three GRPO steps of the tiny model through ``run(cfg)`` with the ``strategy`` overrides."""
    import torch
    from hydra import compose, initialize_config_dir

    from rlhf_lightning.run.fit import run

    with tempfile.TemporaryDirectory() as tmp:
        overrides = [
            *strategy,
            "trainer.max_steps=3",
            "trainer.val_check_interval=3",
            "trainer.enable_progress_bar=false",
            "algo.prompts_per_step=8",
            "algo.group_size=4",
            "env.kwargs.eval_size=16",
            "eval.batch_size=16",
            "checkpoint.every_n_steps=0",
            "logger=csv",
            f"output_dir={tmp}/run",
        ]
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
            cfg = compose(config_name="config", overrides=overrides)
        result = run(cfg)
        lora_b = [p for n, p in result.module.named_parameters() if "lora_B" in n and p.requires_grad]
        moved = bool(lora_b) and any(float(p.detach().float().abs().max()) > 0 for p in lora_b)
        last = Path(tmp) / "run" / "checkpoints" / "last.ckpt"
        ckpt_ok = last.is_file() and "state_dict" in torch.load(last, map_location="cpu", weights_only=True)
        exported = (
            Path(tmp) / "run" / "checkpoints" / "adapters" / "last" / "actor" / "adapter_model.safetensors"
        )
        export_ok = exported.is_file() and exported_adapter_ok(exported)
        d = {
            "exit_code": result.exit_code,
            "global_step": result.trainer.global_step,
            "adapters_moved": moved,
            "last_ckpt_file": ckpt_ok,
            "exported_adapter_ok": export_ok,
            "grad_norm_logged": result.metrics.get("actor/grad_norm"),
            "reward_mean": result.metrics.get("rollout/reward_mean"),
        }
    ok = d["exit_code"] == 0 and d["global_step"] == 3 and moved and ckpt_ok and export_ok
    line = (
        f"exit {d['exit_code']}, {d['global_step']} steps, adapters moved: {moved}, last.ckpt a file: {ckpt_ok}, "
        f"exported adapter whole: {export_ok}, logged actor/grad_norm {d['grad_norm_logged']}"
    )
    return ("pass" if ok else "fail"), line, d


def exported_adapter_ok(path: Path) -> bool:
    """The exported adapter holds whole tensors and a trained (non-zero) lora_B."""
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    whole = bool(tensors) and all(t.numel() > 0 for t in tensors.values())
    return whole and any(float(t.abs().max()) > 0 for k, t in tensors.items() if "lora_B" in k)


def deepspeed_zero2() -> Result:
    return deepspeed_run(2)


# ---------------------------------------------------------------- (e) one LoRA GRPO step, 0.5B
def grpo_step_0p5b() -> Result:
    """One LoRA GRPO update (log-probs, PPO-clip, token mean, backward, AdamW step) on a
    Qwen2.5-0.5B-shaped model in bf16 over 8 rows x 512 tokens (4,096), prompts of 128 tokens."""
    torch = _torch()
    from rlhf_lightning.losses import aggregate, get_policy_loss

    model = qwen(torch, "sdpa", torch.bfloat16)
    policy = lora_policy(torch, model)
    params = policy.trainable_parameters()
    opt = torch.optim.AdamW(params, lr=1e-5)
    b, width, prompt = 8, 512, 128
    ids = torch.randint(3, QWEN_0P5B["vocab_size"], (b, width), device=DEVICE)
    ids[1::2, :prompt] = ids[0::2, :prompt]  # groups of 2 share a prompt
    action = torch.zeros(b, width - 1, dtype=torch.bool, device=DEVICE)
    action[:, prompt - 1 :] = True
    rewards = torch.rand(b // 2, 2, device=DEVICE)
    adv = ((rewards - rewards.mean(-1, keepdim=True)) / (rewards.std(-1, keepdim=True) + 1e-4)).reshape(b)
    before = [p.detach().clone() for p in params]

    def step() -> float:
        logp, _ = policy.token_logprobs(ids, torch.ones_like(ids), action)
        per_token, _ = get_policy_loss("ppo_clip")(logp, logp.detach(), adv, action)
        loss = aggregate(per_token, action, "token_mean")
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    loss, peak, secs = peak_mb(torch, step)
    moved = any(not torch.equal(a, p.detach()) for a, p in zip(before, params))
    d = {"tokens": b * width, "peak_mb": peak, "step_s": secs, "loss": loss, "adapters_moved": moved}
    line = f"{b * width} tokens: peak {peak:.0f} MiB above the weights, {secs:.2f} s, adapters moved: {moved}"
    return ("pass" if moved else "fail"), line, d
