"""vLLM sleep/wake on a GPU: memory freed by sleep and memory growth over cycles, with a weight sync each.

    python bench/gpu_sleep_wake.py --model Qwen/Qwen2.5-0.5B-Instruct --cycles 10
    python bench/gpu_sleep_wake.py --model /models/qwen --level 2 --full      # full-weight sync

For users' GPU machines (CI has no GPU; the loop and the table are tested on the CPU with a fake
engine). Each cycle: wake -> sync weights (LoRA adapter in place, or all weights) -> generate
-> sleep. Reported: the engine's GPU memory when awake, what sleep frees (target: >= 90% at
level 1), and the memory after each sleep compared with the first (target: no growth).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class Cycle:
    cycle: int
    awake_bytes: int
    asleep_bytes: int

    @property
    def freed_frac(self) -> float:
        return 1.0 - self.asleep_bytes / self.awake_bytes if self.awake_bytes else 0.0


def run_cycles(
    engine: Any, policy: Any, cycles: int, used_bytes: Callable[[], int], baseline: int, prompt: list[int]
) -> list[Cycle]:
    """The measured loop: ``used_bytes() - baseline`` is the engine's memory at each point."""
    from rlhf_lightning.records.sampling import SamplingParams

    out = []
    for i in range(cycles):
        engine.wake()
        engine.sync_weights(policy)
        engine.generate([prompt], SamplingParams(max_new_tokens=8, temperature=1.0))
        awake = used_bytes() - baseline
        engine.sleep()
        out.append(Cycle(i, awake, used_bytes() - baseline))
    return out


def table(cycles: list[Cycle]) -> str:
    first = cycles[0].asleep_bytes if cycles else 0
    lines = [
        "| cycle | engine awake (MiB) | asleep (MiB) | freed by sleep | growth since cycle 0 (MiB) |",
        "|---:|---:|---:|---:|---:|",
    ]
    for c in cycles:
        lines.append(
            f"| {c.cycle} | {c.awake_bytes / 2**20:.0f} | {c.asleep_bytes / 2**20:.0f} | "
            f"{100 * c.freed_frac:.1f}% | {(c.asleep_bytes - first) / 2**20:+.0f} |"
        )
    return "\n".join(lines)


def verdict(cycles: list[Cycle], level: int, tolerance_bytes: int = 64 << 20) -> str:
    freed = min(c.freed_frac for c in cycles)
    growth = cycles[-1].asleep_bytes - cycles[0].asleep_bytes
    ok_free = freed >= 0.9 or level != 1
    return (
        f"min freed {100 * freed:.1f}% ({'meets' if ok_free else 'misses'} the >= 90% target at level 1); "
        f"growth over {len(cycles)} cycles {growth / 2**20:+.0f} MiB ({'none' if growth <= tolerance_bytes else 'GROWS'})"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a Hub id or a local model directory")
    ap.add_argument("--cycles", type=int, default=10)
    ap.add_argument("--level", type=int, default=1, choices=[1, 2])
    ap.add_argument("--full", action="store_true", help="full-weight sync instead of a LoRA adapter")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    ap.add_argument("--dtype", default="bfloat16")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench/gpu_sleep_wake.py measures GPU memory: run it on a machine with a CUDA GPU")
    from rlhf_lightning.models.build import build_policy, load_model, load_tokenizer
    from rlhf_lightning.rollout.engines.vllm import VLLMEngine

    tok = load_tokenizer(a.model)
    policy = build_policy(load_model(a.model, dtype=a.dtype).cuda(), finetune="full" if a.full else "lora")
    prompt = tok("Hello", add_special_tokens=False).input_ids

    def used() -> int:
        free, total = torch.cuda.mem_get_info()
        return total - free

    baseline = used()
    engine = VLLMEngine(
        a.model,
        dtype=a.dtype,
        lora_rank=None if a.full else 16,
        gpu_memory_utilization=a.gpu_memory_utilization,
        sleep_mode=True,
        sleep_mode_level=a.level,
    )
    cycles = run_cycles(engine, policy, a.cycles, used, baseline, prompt)
    engine.shutdown()
    print(table(cycles))
    print(verdict(cycles, a.level))


if __name__ == "__main__":
    main()
