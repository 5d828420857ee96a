"""Infrastructure every layer above the models may use: collectives and rank agreement
(``distributed``), the RNG state a run saves and restores (``rng``) and the learning-rate
schedule (``schedule``). Nothing here imports an algorithm, an env or the run."""
