"""Rollout: what the policy samples, in rooms by concern, each importing only the rooms below it:

- `partial/`: partial rollouts: the pool of groups in flight, their admission and the stream
- `agents/`: agents as they are, behind an OpenAI-compatible endpoint: the HTTP surface, the
  recorder that turns calls into token-exact rows, the scheduler of engine calls, the runner
- `episodes/`: the one episode loop, the environment contract, the typed records it hands on
- `engines/`: the engines (vLLM, HF generate), their one interface, weight sync and its checks
- `batch.py` (`RolloutBatch`, what an engine returns) and `seeding.py` (every sampling seed)

Consumes `(name, tensor)` iterables; imports nothing from roles or the trainer.
"""

from .batch import RolloutBatch
from .engines import (
    HFRollout,
    RolloutEngine,
    VLLMRollout,
    choose_engine,
    generate_distributed,
    make_rollout,
    resolve_eager,
    resolve_engine,
    sync_distributed,
)
from .seeding import prompt_seed, prompt_seeds

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
