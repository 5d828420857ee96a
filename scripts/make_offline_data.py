"""Write the small offline datasets shipped in rlhf_lightning/assets (arithmetic, synthetic).

    python scripts/make_offline_data.py

sft_arithmetic.jsonl: {"prompt", "completion"} rows from the arithmetic env's train split.
dpo_arithmetic.jsonl: {"prompt", "chosen", "rejected"} rows: the right answer is chosen, a
near miss (off by 1-10, or two digits swapped) is rejected.
"""

from __future__ import annotations

import json
import random

from rlhf_lightning.config import ASSETS
from rlhf_lightning.envs.arithmetic import make_problem


def near_miss(answer: int, rng: random.Random) -> int:
    s = str(answer)
    if len(s) >= 2 and s[0] != s[1] and rng.random() < 0.3:
        return int(s[1] + s[0] + s[2:])
    return max(0, answer + rng.choice([-1, 1]) * rng.randint(1, 10))


def main() -> None:
    rng = random.Random(0)
    with (ASSETS / "sft_arithmetic.jsonl").open("w") as f:
        for i in range(2000):
            p = make_problem(0, 500_000 + i, False, 10, 99)
            f.write(json.dumps({"prompt": p.question, "completion": str(p.answer)}) + "\n")
    with (ASSETS / "dpo_arithmetic.jsonl").open("w") as f:
        for i in range(1000):
            p = make_problem(0, 600_000 + i, False, 10, 99)
            wrong = near_miss(p.answer, rng)
            while wrong == p.answer:
                wrong = near_miss(p.answer, rng)
            f.write(
                json.dumps({"prompt": p.question, "chosen": str(p.answer), "rejected": str(wrong)}) + "\n"
            )


if __name__ == "__main__":
    main()
