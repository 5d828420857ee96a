"""The records every layer shares: trajectories and their batch, completions and sampling
parameters, rollout results. Plain data and pure functions over it; nothing here imports any
other package of the project (the bottom of the import layers, beside ``runtime/``)."""
