"""Rollout engines (vLLM, HF generate), the `RolloutBatch` they return, and weight sync.

Consumes `(name, tensor)` iterables; imports nothing from roles or the trainer. vLLM itself is
imported only when a `VLLMRollout` is built, so HFRollout works where vLLM is not installed.
"""

from .batch import RolloutBatch
from .distributed import (
    choose_engine,
    generate_distributed,
    make_rollout,
    resolve_eager,
    resolve_engine,
    sync_distributed,
)
from .engine import RolloutEngine
from .hf_rollout import HFRollout
from .seeding import prompt_seed, prompt_seeds
from .vllm_rollout import VLLMRollout

__all__ = [
    "RolloutBatch",
    "RolloutEngine",
    "HFRollout",
    "VLLMRollout",
    "choose_engine",
    "resolve_eager",
    "resolve_engine",
    "make_rollout",
    "generate_distributed",
    "sync_distributed",
    "prompt_seed",
    "prompt_seeds",
]
