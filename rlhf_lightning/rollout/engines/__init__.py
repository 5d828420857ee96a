"""Rollout engines: HF generate, colocated vLLM, and the callback that wakes it."""
