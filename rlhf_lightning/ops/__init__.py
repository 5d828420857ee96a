from rlhf_lightning.ops.logprobs import chunked_logprobs, resolve_chunk_rows

__all__ = ["chunked_logprobs", "resolve_chunk_rows"]
