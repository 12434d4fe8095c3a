"""verl-ds: RL post-training for LLMs on DeepSpeed, with per-role precision."""

__version__ = "0.1.0"
