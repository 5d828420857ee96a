"""Does generation overlap with the update better in a thread or in a process? (2 cores here.)

    .venv/bin/python bench/async_overlap.py            # the default task's batch, 10 rounds

On the default task's model and batch (16 prompts x 8 samples), one torch thread per worker:
``generate`` is one rollout of the harness, ``update`` one forward and backward of the policy on
a rollout batch. It times each alone, then both at once (``generate`` looping in a second thread
of this process, or in a second process with its own model) and prints the overlap: serial time
(generate + update) over the wall time of doing both together, 2.00 at best.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from a checkout

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

ROWS = list(range(16))


def parts() -> tuple:
    """The default run's harness, engine, policy and sampling parameters, in this process."""
    from hydra import compose, initialize_config_dir

    from rlhf_lightning.config import register_configs
    from rlhf_lightning.models.build import build_policy
    from rlhf_lightning.run.factories import (
        build_engine,
        harness_from,
        model_from,
        sampling_from,
        tokenizer_from,
    )

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(config_name="config")
    tokenizer = tokenizer_from(cfg.model, cfg.env)
    harness, _, _ = harness_from(cfg, tokenizer, online=True)
    policy = build_policy(model_from(cfg.model), lora_r=cfg.model.lora.r, lora_alpha=cfg.model.lora.alpha)
    return (
        harness,
        build_engine(cfg, policy, tokenizer),
        policy,
        sampling_from(cfg.rollout),
        cfg.algo.group_size,
    )


def generate(harness, engine, sampling, group_size) -> object:
    return harness.rollout(engine, ROWS, sampling, group_size=group_size)


def update(policy, batch) -> None:
    logp = policy.forward_heads(batch, ("logp",))["logp"]
    (logp * batch.action_mask).sum().backward()


def loop(fn, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return time.perf_counter() - t0


def generator_process(n: int, ready, go, done) -> None:
    torch.set_num_threads(1)
    harness, engine, _, sampling, group_size = parts()
    generate(harness, engine, sampling, group_size)  # warm
    ready.set()
    go.wait()
    t = loop(lambda: generate(harness, engine, sampling, group_size), n)
    done.put(t)


def main(n: int = 10) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    harness, engine, policy, sampling, group_size = parts()
    batch = generate(harness, engine, sampling, group_size).batch
    gen = lambda: generate(harness, engine, sampling, group_size)  # noqa: E731
    upd = lambda: update(policy, batch)  # noqa: E731
    gen(), upd()  # warm
    g, u = loop(gen, n), loop(upd, n)
    # A second thread of this process.
    t_gen: list[float] = []
    th = threading.Thread(target=lambda: t_gen.append(loop(gen, n)))
    t0 = time.perf_counter()
    th.start()
    t_upd = loop(upd, n)
    th.join()
    threads = time.perf_counter() - t0
    # A second process with its own model.
    ctx = mp.get_context("spawn")
    ready, go, done = ctx.Event(), ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=generator_process, args=(n, ready, go, done))
    proc.start()
    ready.wait()
    t0 = time.perf_counter()
    go.set()
    loop(upd, n)
    done.get()
    processes = time.perf_counter() - t0
    proc.join()
    serial = g + u
    print(
        f"{n} rounds, 1 torch thread each: generate {g / n:.3f} s, update {u / n:.3f} s, serial {serial / n:.3f} s"
    )
    print("| both at once in | wall s per round | overlap (serial / wall) |")
    print("|---|---:|---:|")
    print(f"| two threads of one process | {threads / n:.3f} | {serial / threads:.2f} |")
    print(f"| two processes | {processes / n:.3f} | {serial / processes:.2f} |")
    print(f"(in the threads run, generate took {t_gen[0] / n:.3f} s and update {t_upd / n:.3f} s per round)")


if __name__ == "__main__":
    main()
