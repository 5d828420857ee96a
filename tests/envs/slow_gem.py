"""A GEM game whose steps can run over their time limit (a module of its own: importing GEM's
adapter costs a worker process more than the light envs of ``slow_things``)."""

from __future__ import annotations

import time

from rlhf_lightning.envs.gem import GemEnv


class SlowGem(GemEnv):
    """A GEM game whose row-1 episodes sleep 3 s in every step."""

    def reset(self, seed=None, *, row_index=None, evaluation=False):
        self.row = int(row_index or 0)
        return super().reset(seed, row_index=row_index, evaluation=evaluation)

    def step(self, action):
        if self.row == 1:
            time.sleep(3.0)
        return super().step(action)
