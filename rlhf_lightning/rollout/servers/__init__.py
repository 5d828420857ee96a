"""vLLM inference servers: the engine over HTTP, its client, answers, process and weights."""
