"""What a batched population step could cost: N members' rollouts in one mixed-adapter call
against one member's, and whether one mixed-adapter backward trains each member exactly.

    .venv/bin/python bench/population_batched.py                   # N = 1 2 4 8, the default step
    .venv/bin/python bench/population_batched.py --members 1 4 --repeats 3

The default step: 32 prompts x group 8, 8 new tokens, the tiny model with a LoRA actor. Each
member is an adapter of its own (random weights, so members generate differently). Timed, the
median of ``--repeats`` runs after a warm-up:

- ``generate``: ``HFEngine.generate`` of every member's 256 completions in one call, each row
  under its member's adapter (``adapters=[...]``);
- ``round-robin``: N calls of one member each, as the population runs today (N x one).

First, one forward and backward of the token log-probs of three members' rows, each row under
its adapter (PEFT takes per-row adapters in eval mode only: with LoRA dropout 0 that forward is
the training one), is checked: the gradient each member's adapter gets equals the gradient of
that member's rows alone (scaled by their share of the tokens). This is a projection for issue
27, not a population step: no scoring, env, update or bookkeeping is timed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from a checkout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--members", nargs="+", type=int, default=[1, 2, 4, 8])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()

    from rlhf_lightning.envs.arithmetic import ArithmeticEnv
    from rlhf_lightning.models.adapters import ACTOR
    from rlhf_lightning.models.build import build_policy, load_model, load_tokenizer
    from rlhf_lightning.models.tiny import TINY_MODEL_DIR
    from rlhf_lightning.records.sampling import SamplingParams
    from rlhf_lightning.records.trajectory import Trajectory, collate
    from rlhf_lightning.rollout.engines.hf import HFEngine
    from rlhf_lightning.rollout.episodes.harness import ChatFormatter

    path = str(TINY_MODEL_DIR)
    tok = load_tokenizer(path)
    policy = build_policy(load_model(path, dtype="float32", attn_implementation="eager"), finetune="lora")
    peft = policy.model
    names = [ACTOR] + [f"member{i}" for i in range(1, max(a.members))]
    for name in names[1:]:
        peft.add_adapter(name, peft.peft_config[ACTOR])
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    for n, p in peft.named_parameters():
        p.requires_grad_("lora_" in n)
    peft.set_adapter(ACTOR)
    for n, p in peft.named_parameters():  # set_adapter froze the others: every member trains
        p.requires_grad_("lora_" in n)

    formatter = ChatFormatter(tok)
    prompt_ids = [
        formatter.prompt_ids(ArithmeticEnv().reset(row_index=r, seed=r)[0]) for r in range(a.prompts)
    ]
    params = SamplingParams(a.max_new_tokens, temperature=1.0, n=a.group)
    engine = HFEngine(policy.generation_model, tok.pad_token_id, [tok.eos_token_id])

    def generate(n: int):
        return engine.generate(prompt_ids * n, params, [m for m in names[:n] for _ in prompt_ids])

    def batch_of(comps):
        trajs = []
        for c in comps:
            p = prompt_ids[c.prompt_index % len(prompt_ids)]
            trajs.append(
                Trajectory(
                    p + c.token_ids,
                    [-1] * len(p) + [0] * len(c.token_ids),
                    [0.0] * (len(p) + len(c.token_ids)),
                    [0.0],
                    0,
                    len(p),
                )
            )
        return collate(trajs, tok.pad_token_id)

    def update(batch, row_adapters):
        peft.eval()  # PEFT takes per-row adapters in eval mode only (LoRA dropout is 0)
        out = peft(input_ids=batch.input_ids, attention_mask=batch.attention_mask, adapter_names=row_adapters)
        logp = out.logits[:, :-1].float().log_softmax(-1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
        loss = -(logp * batch.action_mask).sum() / batch.action_mask.sum()
        loss.backward()
        peft.train()

    def grads(member: str) -> torch.Tensor:
        return torch.cat(
            [
                p.grad.flatten()
                for n, p in peft.named_parameters()
                if f".{member}." in n and p.grad is not None
            ]
        )

    # The mixed batch's gradient reaches each member's adapter as that member's rows alone do
    # (the loss is a sum over rows of per-member terms: scale each alone by its share).
    n_check = min(3, len(names))
    torch.manual_seed(0)
    comps = generate(n_check)
    batch = batch_of(comps)
    per = len(comps) // n_check
    rows = [names[i // per] for i in range(len(comps))]
    peft.zero_grad()
    update(batch, rows)
    mixed = {m: grads(m).clone() for m in names[:n_check]}
    total = batch.action_mask.sum()
    for k, m in enumerate(names[:n_check]):
        peft.zero_grad()
        sub = batch_of(comps[k * per : (k + 1) * per])
        update(sub, [m] * per)
        alone = grads(m) * (sub.action_mask.sum() / total)
        gap = (mixed[m] - alone).abs().max().item()
        print(f"gradient check, {m}: max |mixed - alone| = {gap:.2e}", file=sys.stderr)
        assert gap < 1e-5 * max(1.0, alone.abs().max().item()), (m, gap)

    def timed(fn) -> float:
        fn()
        times = []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    print(f"torch threads: {torch.get_num_threads()}; {a.prompts} prompts x group {a.group} per member")
    print("| members | one call, s | x one member | round-robin, x one member |")
    print("|---:|---:|---:|---:|")
    base = None
    for n in a.members:
        torch.manual_seed(0)
        gen_s = timed(lambda n=n: generate(n))
        base = base or gen_s
        print(f"| {n} | {gen_s:.3f} | {gen_s / base:.2f} | {n:.2f} |", flush=True)


if __name__ == "__main__":
    main()
