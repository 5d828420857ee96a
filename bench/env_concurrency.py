"""One turn of a batch whose env steps are slow (I/O, a tool, a remote service): serial vs
concurrent stepping (``env.concurrency``), with the tiny model generating the replies.

    .venv/bin/python bench/env_concurrency.py                      # 16 episodes, 0.5 s per step
    .venv/bin/python bench/env_concurrency.py --episodes 64 --sleep 0.2 --concurrency 1 8 64

Each row is the median of ``--repeats`` single-turn rollouts (after one warm-up, which starts
the worker processes); the trajectories of every setting are checked equal to the serial ones.
``--workers``: where concurrent steps run, worker processes (``env.step_workers=process``, the
default) and/or threads. Prints one markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path


class SleepyEnv:
    """A one-turn env whose step sleeps ``sleep`` seconds (releasing the GIL, as I/O does)."""

    def __init__(self, sleep: float) -> None:
        self.sleep = sleep

    def reset(self, seed=None, *, row_index=None, evaluation=False):
        self.row = int(row_index or 0)
        return f"What is {self.row} plus 1?", {}

    def step(self, action: str):
        time.sleep(self.sleep)
        return "", float(action.strip() == str(self.row + 1)), True, False, {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--sleep", type=float, default=0.5, help="seconds per env step")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--workers", nargs="+", default=["process", "thread"], choices=["process", "thread"])
    a = ap.parse_args()
    import torch

    torch.set_num_threads(a.threads)
    # A worker process unpickles the env by its module's name: this file as a module, not __main__.
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from env_concurrency import SleepyEnv as Env  # type: ignore[import-not-found]

    from rlhf_lightning.models.build import build_policy, load_model, load_tokenizer
    from rlhf_lightning.models.tiny import TINY_MODEL_DIR
    from rlhf_lightning.records.sampling import SamplingParams
    from rlhf_lightning.rollout.engines.hf import HFEngine
    from rlhf_lightning.rollout.episodes.chat import ChatFormatter
    from rlhf_lightning.rollout.episodes.harness import RolloutHarness

    tok = load_tokenizer(str(TINY_MODEL_DIR))
    policy = build_policy(load_model(str(TINY_MODEL_DIR), dtype="float32", attn_implementation="eager"))
    engine = HFEngine(policy.generation_model, tok.pad_token_id, [tok.eos_token_id], None, tokenizer=tok)
    params = SamplingParams(6, temperature=0.0)  # greedy: every setting sees the same replies
    rows = list(range(a.episodes))
    reference = None
    print(
        f"| env.concurrency | env.step_workers | turn wall time (s) | vs {a.episodes} x {a.sleep} s serial sleep |"
    )
    print("|---|---|---|---|")
    settings = [(c, w) for c in a.concurrency for w in (a.workers if c > 1 else ["-"])]
    for c, w in settings:
        workers = w if w != "-" else "process"
        harness = RolloutHarness(
            lambda: Env(a.sleep), tok, ChatFormatter(tok), concurrency=c, step_workers=workers
        )
        times = []
        for r in range(a.repeats + 1):
            started = time.perf_counter()
            result = harness.rollout(engine, rows, params)
            if r:
                times.append(time.perf_counter() - started)
        ids = [t.token_ids for t in result.trajectories], [t.rewards for t in result.trajectories]
        reference = reference or ids
        assert ids == reference, f"concurrency={c} ({w}) changed the trajectories"
        wall = statistics.median(times)
        print(f"| {c} | {w} | {wall:.2f} | {wall / (a.episodes * a.sleep):.2f}x |")
        harness.close()


if __name__ == "__main__":
    main()
