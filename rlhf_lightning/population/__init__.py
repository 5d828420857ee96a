"""Population training: N LoRA members on one frozen base, evolved while they train."""
