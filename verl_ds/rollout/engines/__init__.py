"""Rollout engines: the one interface the loop uses (`engine`), vLLM in every rank (`vllm_rollout`, its
worker extension and the vLLM internals it reads), HF generate (`hf_rollout`), the checkpoint facts
both need and the sync's checks (`weights`), and generation across ranks (`distributed`).

vLLM itself is imported only when a `VLLMRollout` is built, so HFRollout works where vLLM is not
installed."""

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
from .vllm_rollout import VLLMRollout

__all__ = [
    "RolloutEngine",
    "HFRollout",
    "VLLMRollout",
    "choose_engine",
    "resolve_eager",
    "resolve_engine",
    "make_rollout",
    "generate_distributed",
    "sync_distributed",
]
