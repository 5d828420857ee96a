"""rlhf_lightning: RL fine-tuning of language models on PyTorch Lightning and Hydra."""

__version__ = "0.1.0"
