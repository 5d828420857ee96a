"""Peak memory of one CISPO update on ONE long GEM Sudoku-Hard episode (``env.history=full``),
at 4k, 8k, 16k and 32k tokens, with the memory features on and off: AgileRL's "32k-token,
50-turn Sudoku episodes" claim in miniature, on the Qwen2.5-0.5B shape (random weights).

    .venv/bin/python bench/long_episode_memory.py                       # estimates, every size and arm
    .venv/bin/python bench/long_episode_memory.py --measure 4096        # + measured peaks at 4k
    .venv/bin/python bench/long_episode_memory.py --model tiny_sudoku --sizes 1024 --measure 1024

The episode: ``game:Sudoku-v0-hard`` (GEM's 9x9, up to 50 clues removed, 50 turns) through the
rollout harness with ``env.history=full``, token-exact as training sees it, in the tiny Sudoku
tokenizer's ids. The scripted player of ``bench/sudoku_memory.py`` moves (right half the time,
never a malformed reply, so no episode ends early), and each reply opens with a reasoning of
``--think`` tokens (the candidates of the board's empty cells, read in order, as a reasoning model
writes before its move): a turn is GEM's feedback and 9x9 board (~290 tokens) plus the reply
(~365), so 50 turns make the claim's 32k tokens. A size plays the first turns of the same game
(the turn count whose tokens come nearest the size).

One update: LoRA r=16 on every linear layer (``build_policy``, the training path), forward and
backward of CISPO's loss (token mean) on the reply tokens, one micro-batch. Arms: log-probs
chunked (``Policy.forward_heads``) or naive (the body, ``(L, V)`` logits, ``log_softmax``,
gather); gradient checkpointing on or off (``model.gradient_checkpointing``); float32 or bfloat16
weights (``model.dtype``). Activation offload to the CPU (``torch.autograd.graph.save_on_cpu``) is
only a saving where activations live on a GPU: not run here, and not a framework option.

Memory, two columns never mixed:
- estimated: the same step traced without compute, the model's weights and activations fake
  tensors (``FakeTensorMode``; the batch's ids and masks keep their values, so data-dependent
  shapes are exact), the live tensor bytes tracked by torch's ``MemTracker``; the peak over the
  step less what was live before it. Also the step's total (weights + LoRA + peak) and the
  widest tensors alive at the peak (their row width names them: 151936 the logits, 4864 the MLP).
- measured: peak RSS growth over the step (``VmHWM`` reset before it, after a warm-up step on a
  one-turn episode and ``malloc_trim``), each arm in its own process, one thread; where the
  estimate says it fits ``--max-gib``.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "scripts"))

SIZES = (4096, 8192, 16384, 32768)
MAX_TURNS = 50  # game:Sudoku-v0-hard's own limit
ENV_ID = "game:Sudoku-v0-hard"
# glibc's malloc with a fixed mmap threshold: every block over 64 KiB is its own mapping, given
# back when freed, so RSS follows the live tensors (its default threshold grows with the blocks
# freed and keeps freed heap: the tiny model's peak RSS growth is then ~1.8x its live bytes)
MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
# (log-probs, gradient checkpointing, dtype), the feature-less arm first
ARMS = [(lp, ck, dt) for dt in ("float32", "bfloat16") for ck in (False, True) for lp in ("naive", "chunked")]


def arm_name(arm: tuple[str, bool, str]) -> str:
    lp, ck, dt = arm
    return f"{lp}, ckpt {'on' if ck else 'off'}, {'bf16' if dt == 'bfloat16' else 'fp32'}"


def parse_arm(text: str) -> tuple[str, bool, str]:
    lp, ck, dt = text.split(",")
    return lp, ck == "1", dt


# ---------------------------------------------------------------------------------------------
# the episode


class ThinkingPlayer:
    """The scripted Sudoku player (``make_gem_sft_data.sudoku_policy``, no malformed replies),
    each reply a reasoning of about ``think`` tokens then the move."""

    def __init__(self, tokenizer: Any, quality: float, seed: int, think: int) -> None:
        import random

        from make_gem_sft_data import sudoku_policy

        self.tok, self.think, self.rng = tokenizer, think, random.Random(seed)
        self.policy = sudoku_policy(quality, {"malformed": 0.0})

    def reasoning(self, text: str) -> str:
        """The empty cells' candidates in reading order, cycled until ``think`` tokens."""
        from make_gem_sft_data import candidates, parse_board

        board = parse_board(text)
        n = len(board)
        lines = [
            f"R{r + 1}C{c + 1} can be {' '.join(map(str, sorted(candidates(board, r, c))))}."
            for r in range(n)
            for c in range(n)
            if not board[r][c]
        ] or ["The board is full."]
        out: list[str] = []
        count = 0
        while count < self.think:
            line = lines[len(out) % len(lines)]
            out.append(line)
            count += len(self.tok(" " + line, add_special_tokens=False).input_ids)
        return " ".join(out) + " So my move: " if out else ""

    def generate(self, prompts: list[list[int]], params: Any) -> list[Any]:
        from rlhf_lightning.records.sampling import Completion

        out = []
        for i, ids in enumerate(prompts):
            text = self.tok.decode(ids, skip_special_tokens=True)
            reply = self.reasoning(text) + self.policy([{"role": "user", "content": text}], self.rng)
            reply_ids = [*self.tok(reply, add_special_tokens=False).input_ids, self.tok.eos_token_id]
            out.append(Completion(reply_ids, [-1.0] * len(reply_ids), "stop", i))
        return out


def play(tok: Any, turns: int, think: int, seed: int = 0) -> Any:
    """One ``game:Sudoku-v0-hard`` episode of at most ``turns`` turns, as the harness builds it."""
    from rlhf_lightning.envs.gem import GemEnv
    from rlhf_lightning.records.sampling import SamplingParams
    from rlhf_lightning.rollout.episodes.chat import ChatFormatter
    from rlhf_lightning.rollout.episodes.harness import RolloutHarness

    harness = RolloutHarness(
        lambda: GemEnv(id=ENV_ID),
        tok,
        ChatFormatter(tok),
        max_turns=turns,
        max_model_len=1 << 20,
        history="full",
    )
    return harness.rollout(ThinkingPlayer(tok, 0.5, seed, think), [0], SamplingParams(4096)).batch


def turn_lengths(batch: Any) -> list[int]:
    """Tokens of a one-episode batch cut after each of its turns as the harness cuts it (up to
    where the next reply starts: the next observation and the assistant's header stay), the
    last turn whole."""
    acts = batch.action_mask[0].tolist()
    starts = [t + 1 for t in range(len(acts)) if acts[t] and (t == 0 or not acts[t - 1])]
    return [*starts[1:], int(batch.attention_mask.sum())]


def episode(tok: Any, size: int, think: int, seed: int = 0) -> Any:
    """The first turns of the 50-turn game whose token count comes nearest ``size``."""
    lengths = turn_lengths(play(tok, MAX_TURNS, think, seed))
    turns = 1 + min(range(len(lengths)), key=lambda k: abs(lengths[k] - size))
    return play(tok, turns, think, seed)


# ---------------------------------------------------------------------------------------------
# the model and the update


def model_config(model: str) -> Any:
    from transformers import AutoConfig, Qwen2Config

    from rlhf_lightning.models.tiny import ASSETS

    if model == "qwen0.5b-shape":  # Qwen2.5-0.5B's architecture
        return Qwen2Config(vocab_size=151_936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                           num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                           tie_word_embeddings=True)  # fmt: skip
    return AutoConfig.from_pretrained(str(ASSETS / model))


def load_tokenizer() -> Any:
    from transformers import AutoTokenizer

    from rlhf_lightning.models.tiny import ASSETS

    return AutoTokenizer.from_pretrained(str(ASSETS / "tiny_sudoku"))


def build(model: str, ckpt: bool, dtype: str, meta: bool) -> Any:
    """The policy as training builds it (``build_policy``: LoRA r=16, all-linear), random weights;
    ``meta``: no storage (the estimate swaps in fake tensors)."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlhf_lightning.models.build import build_policy

    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        lm = AutoModelForCausalLM.from_config(
            model_config(model), dtype=getattr(torch, dtype), attn_implementation="sdpa"
        )
    return build_policy(lm, lora_r=16, lora_alpha=32, gradient_checkpointing=ckpt)


def update(policy: Any, b: Any, logprobs: str) -> None:
    """One CISPO update's forward and backward (token mean) on the reply tokens of ``b``."""
    import torch

    from rlhf_lightning.losses import aggregate, get_policy_loss

    if logprobs == "chunked":
        lp = policy.forward_heads(b, ("logp",))["logp"]
    else:  # the naive way: (L, V) logits, log_softmax, gather
        logits = policy.causal_lm(input_ids=b.input_ids, attention_mask=b.attention_mask).logits
        all_lp = logits[:, :-1].float().log_softmax(-1).gather(-1, b.input_ids[:, 1:, None]).squeeze(-1)
        lp = torch.zeros(b.action_mask.shape, dtype=all_lp.dtype).masked_scatter(
            b.action_mask, all_lp[b.action_mask]
        )
    adv = torch.full(b.action_mask.shape, 0.5)  # the memory does not depend on the advantages' values
    per_token, _ = get_policy_loss("cispo")(lp, lp.detach(), adv, b.action_mask)
    aggregate(per_token, b.action_mask, "token_mean").backward()


def shape_of(b: Any) -> dict:
    tokens = int(b.attention_mask.sum())
    turns = int(b.num_turns[0])
    return {
        "tokens": tokens,
        "turns": turns,
        "tokens_per_turn": tokens / turns,
        "reply_tokens": int(b.action_mask.sum()),
    }


# ---------------------------------------------------------------------------------------------
# estimate: the update traced on fake tensors


def estimate(model: str, size: int, arm: tuple[str, bool, str], think: int) -> dict:
    import torch
    import torch._subclasses.fake_tensor as fake_tensor
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.common_utils import get_untyped_storages
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.utils.weak import WeakIdKeyDictionary
    from transformers import masking_utils

    b = episode(load_tokenizer(), size, think)
    policy = build(model, arm[1], arm[2], meta=True)
    fake_tensor.CONSTANT_NUMEL_LIMIT = 1 << 22  # the batch's ids and masks keep their values
    mode = FakeTensorMode()

    def fake(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return mode.fake_tensor_converter.from_real_tensor(mode, x, make_constant=True)
        return x

    fb = type(b)(**{f.name: fake(getattr(b, f.name)) for f in dataclasses.fields(b)})
    # transformers never skips the causal mask for a fake tensor (it may be tracing a graph); the
    # batch's masks keep their values here, so let it decide as it does on the real tensors (a
    # one-row batch without padding: no (L, L) mask, SDPA's is_causal)
    masking_utils.is_tracing = lambda tensor=None: False

    class Tracker(MemTracker):
        """MemTracker keeping the global peak only (per-module peaks cost O(modules) per op) and
        the widest tensors alive at it; frozen weights take no gradient hooks."""

        def __init__(self) -> None:
            super().__init__()
            self.top: list[tuple[int, str]] = []
            self.recorded = 0
            self.shapes: Any = WeakIdKeyDictionary()  # storage -> the shape and dtype it was made with

        def _track(self, reftype: Any, t: torch.Tensor) -> None:
            super()._track(reftype, t)
            for st in get_untyped_storages(t):
                if st not in self.shapes:
                    self.shapes[st] = f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"

        def _track_module_params_and_buffers(self, module: Any, install_grad_hooks: bool = True) -> Any:
            return super()._track_module_params_and_buffers(module, install_grad_hooks=False)

        def _update_peak_stats(self, peak_state: Any) -> None:
            for dev, snap in self._curr_mem_snap.items():
                total = snap["Total"]
                if self._peak_mem.get(dev, 0) < total:
                    self._peak_mem[dev], self._peak_mem_snap[dev] = total, dict(snap)
                    if total > 1.02 * self.recorded:  # within 2% of the peak
                        self.recorded = total
                        sizes = sorted(
                            (w.mem_consumed, self.shapes.get(st, "?")) for st, (w, _) in self._WINFO.items()
                        )
                        self.top = sizes[-6:]

    with mode:
        memo: dict[int, torch.nn.Parameter] = {}  # tied weights stay tied
        for m in policy.modules():
            for n, p in list(m._parameters.items()):
                if p is not None:
                    if id(p) not in memo:
                        memo[id(p)] = torch.nn.Parameter(
                            torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad
                        )
                    m._parameters[n] = memo[id(p)]
            for n, buf in list(m._buffers.items()):
                if buf is not None:
                    m._buffers[n] = torch.empty(buf.shape, dtype=buf.dtype)
        tracker = Tracker()
        tracker.track_external(policy)
        with tracker:
            before = tracker.get_tracker_snapshot("current")[torch.device("cpu")]["Total"]
            update(policy, fb, arm[0])
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    return {
        **shape_of(b),
        "size": size,
        "arm": list(arm),
        "est_mb": (peak - before) / 2**20,
        "est_total_mb": peak / 2**20,
        "weights_mb": before / 2**20,
        "widest_at_peak": [[round(mb / 2**20, 1), shape] for mb, shape in tracker.top],
    }


# ---------------------------------------------------------------------------------------------
# measure: the update run, peak RSS growth


def status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def measure(model: str, size: int, arm: tuple[str, bool, str], think: int) -> dict:
    import gc

    import torch

    torch.set_num_threads(1)
    tok = load_tokenizer()
    b, warm = episode(tok, size, think), play(tok, 1, think)
    policy = build(model, arm[1], arm[2], meta=False)
    update(policy, warm, arm[0])  # kernels, thread pools and lazy imports, outside the peak
    policy.zero_grad(set_to_none=True)
    del warm
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    base = status_kib("VmRSS")
    t0 = time.perf_counter()
    update(policy, b, arm[0])
    seconds = time.perf_counter() - t0
    return {
        **shape_of(b),
        "size": size,
        "arm": list(arm),
        "measured_mb": (status_kib("VmHWM") - base) / 1024,
        "step_s": seconds,
    }


# ---------------------------------------------------------------------------------------------
# the table


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (tokens, MB) points, in MB per 1k tokens (nan under two points)."""
    if len(points) < 2:
        return math.nan
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return 1000 * sum((x - mx) * (y - my) for x, y in points) / sxx


def fmt(v: float | None, spec: str = ".0f") -> str:
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def table(rows: list[dict]) -> str:
    """One markdown line per (size, arm): rows hold ``estimate``'s keys and maybe ``measure``'s."""
    lines = [
        "| size | tokens | turns | tokens / turn | arm | measured MB | estimated MB | est. total GiB | step s |",
        "|---:|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['size'] // 1024}k | {r['tokens']} | {r['turns']} | {r['tokens_per_turn']:.0f} | "
            f"{arm_name(tuple(r['arm']))} | {fmt(r.get('measured_mb'))} | {fmt(r.get('est_mb'))} | "
            f"{fmt(r['est_total_mb'] / 1024 if 'est_total_mb' in r else None, '.2f')} | {fmt(r.get('step_s'), '.1f')} |"
        )
    return "\n".join(lines)


def slopes(rows: list[dict]) -> str:
    lines = ["| arm | estimated MB per 1k tokens | measured MB per 1k tokens |", "|---|---:|---:|"]
    for arm in ARMS:
        mine = [r for r in rows if tuple(r["arm"]) == arm]
        if not mine:
            continue
        est = slope([(r["tokens"], r["est_mb"]) for r in mine if "est_mb" in r])
        got = slope([(r["tokens"], r["measured_mb"]) for r in mine if "measured_mb" in r])
        lines.append(f"| {arm_name(arm)} | {fmt(est, '.1f')} | {fmt(got, '.1f')} |")
    return "\n".join(lines)


def child(
    kind: str, model: str, size: int, arm: tuple[str, bool, str], think: int, malloc: dict = MALLOC
) -> dict | None:
    cmd = [sys.executable, __file__, "--model", model, "--think", str(think),
           "--child", kind, str(size), ",".join([arm[0], str(int(arm[1])), arm[2]])]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(malloc if kind == "measure" else {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if proc.returncode != 0:
        print(
            f"{kind} {size} {arm_name(arm)} failed (exit {proc.returncode}):\n{proc.stderr[-1500:]}",
            file=sys.stderr,
        )
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def available_gib() -> float:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:")) / 2**20


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", default="qwen0.5b-shape", help="qwen0.5b-shape or an embedded model (tiny_sudoku)"
    )
    ap.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    ap.add_argument(
        "--arms", nargs="+", default=None, help="lp,ckpt,dtype e.g. chunked,1,bfloat16 (default: all 8)"
    )
    ap.add_argument("--measure", type=int, nargs="*", default=[], help="sizes to run for real too")
    ap.add_argument(
        "--max-gib", type=float, default=18.0, help="run for real only where the estimate is below"
    )
    ap.add_argument("--think", type=int, default=350, help="reasoning tokens opening each reply")
    ap.add_argument("--default-malloc", action="store_true", help="measure under glibc's default thresholds")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--child", nargs=3, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        fn = estimate if a.child[0] == "estimate" else measure
        print(json.dumps(fn(a.model, int(a.child[1]), parse_arm(a.child[2]), a.think)))
        return []
    arms = [parse_arm(s) for s in a.arms] if a.arms else ARMS
    rows = []
    for size in a.sizes:
        for arm in arms:
            row = child("estimate", a.model, size, arm, a.think)
            if row is None:
                continue
            if size in a.measure:
                need = row["est_total_mb"] / 1024
                if need > a.max_gib or need + 2 > available_gib():
                    print(f"{size} {arm_name(arm)}: estimated {need:.1f} GiB (max {a.max_gib}, "
                          f"available {available_gib():.1f}), not run", file=sys.stderr)  # fmt: skip
                else:
                    got = child("measure", a.model, size, arm, a.think, {} if a.default_malloc else MALLOC)
                    row.update({k: got[k] for k in ("measured_mb", "step_s")} if got else {})
            rows.append(row)
            print(f"{size} {arm_name(arm)}: {json.dumps(row)}", file=sys.stderr, flush=True)
            if a.json:
                a.json.write_text(json.dumps(rows, indent=1))
    print(
        f"\n{a.model}, one {ENV_ID} episode (env.history=full) per size, one CISPO update, LoRA r=16, 1 thread\n"
    )
    print(table(rows))
    print()
    print(slopes(rows))
    return rows


if __name__ == "__main__":
    main()
