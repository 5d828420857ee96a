"""One rank of the 2-process reward-normalisation check in test_normalize.py (gloo, CPU).

    python tests/rewards/normalize_worker.py SPEC.json RANK

SPEC: {"world": 2, "init_file": path, "out": path prefix, "env": [[...] per rank], "raw": [[round
scores, ...] per rank]}. Each rank scores its rounds with ``CombinedReward.apply`` (one call per
round, like dynamic sampling's refills), then runs ``finalize`` once with the real
``distributed.all_sum``, and writes its rewards and metrics to ``OUT.RANK.json``.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


class Scripted:
    """A batch-normalised component returning the next round's raw scores on each call."""

    name = "model"
    normalize = "batch"

    def __init__(self, rounds: list[list[float]]) -> None:
        self.rounds = list(rounds)

    def score(self, episodes, device):
        return self.rounds.pop(0)


def main(spec_path: str, rank: int) -> None:
    import torch.distributed as dist

    from rlhf_lightning.records.trajectory import Trajectory
    from rlhf_lightning.rewards import CombinedReward
    from rlhf_lightning.runtime.distributed import all_sum

    spec = json.loads(Path(spec_path).read_text())
    world = spec["world"]
    dist.init_process_group(
        "gloo", init_method=f"file://{spec['init_file']}", rank=rank, world_size=world,
        timeout=timedelta(seconds=60),
    )  # fmt: skip
    rounds, env = spec["raw"][rank], iter(spec["env"][rank])
    reward = CombinedReward([Scripted(rounds)], {"env": 1.0, "model": 0.5}, use_env=True)
    trajectories = []
    for scores in rounds:
        new = [
            Trajectory(token_ids=[1], action_turn=[-1], sampling_logps=[0.0], rewards=[next(env)],
                       group_id=0, prompt_len=1, replies=["r"])
            for _ in scores
        ]  # fmt: skip
        reward.apply(new)
        trajectories += new
    metrics = reward.finalize(trajectories, lambda t: all_sum(t, world))
    out = {"rewards": [t.rewards for t in trajectories], "metrics": metrics}
    Path(f"{spec['out']}.{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
