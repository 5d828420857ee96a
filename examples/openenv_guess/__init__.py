"""Guess the number: a small OpenEnv environment (typed action and observation, a FastAPI server,
an ``EnvClient``), written for docs/guides/environments.md and the tests of ``env=openenv``.

    python train.py env=openenv model=tiny_chat      # conf/env/openenv.yaml points here
"""
