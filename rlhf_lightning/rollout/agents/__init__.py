"""Agents that drive their own conversation: the policy behind an OpenAI-compatible endpoint
(endpoint.py, openai_api.py), their recorded calls as token-exact trajectories (assembly.py), and
the episode driver of env=agent (runner.py)."""
