"""Rollout engines (vLLM, HF generate), the `RolloutBatch` they return, and weight sync.

Consumes `(name, tensor)` iterables; imports nothing from roles or the trainer. vLLM itself is
imported only when a `VLLMRollout` is built, so HFRollout works where vLLM is not installed.
"""
from .batch import RolloutBatch
from .distributed import generate_distributed, make_rollout, sync_distributed
from .hf_rollout import HFRollout
from .seeding import prompt_seed, prompt_seeds
from .vllm_rollout import VLLMRollout

__all__ = ["RolloutBatch", "HFRollout", "VLLMRollout", "make_rollout", "generate_distributed",
           "sync_distributed", "prompt_seed", "prompt_seeds"]
