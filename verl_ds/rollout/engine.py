"""The one interface the loop uses of a rollout engine. `VLLMRollout` and `HFRollout` implement all of
it (tests/rollout/test_engine_choice.py checks the members and their signatures), so callers never
probe an engine for what it has."""

from __future__ import annotations

from typing import Iterable, Protocol, runtime_checkable

import torch

from .batch import RolloutBatch


@runtime_checkable
class RolloutEngine(Protocol):
    tp: int  # ranks that share this engine (a vLLM tensor-parallel group; HF generate: 1)
    start_s: float  # seconds the engine took to start
    last_metrics: dict[str, float]  # the last generate call's timing_s/gen and perf/* numbers
    pad_id: int  # the id rows are padded with (episodes assemble multi-turn rows with it)

    def generate(
        self,
        prompt_token_ids: list[list[int]],
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_new_tokens: int = 16,
        seeds: list[int] | None = None,
    ) -> RolloutBatch:
        """`n` samples per prompt, contiguous per prompt; `seeds[i]` seeds prompt i's samples."""
        ...

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
        """Load the trainer's full weights, `(hf_name, tensor)` pairs, in place; timing metrics."""
        ...

    def sleep(self, level: int) -> None:
        """Free what the engine holds while the roles train (GPU: the KV cache and the weights; `level`
        2 discards the weights, for a sync to replace; 1 keeps them on the host)."""
        ...

    def wake_up(self) -> None:
        """Take back what `sleep` freed, before generating (a sync wakes the weights it loads)."""
        ...

    def shutdown(self, release: bool = True) -> None:
        """Stop the engine (`release`: free its memory now)."""
        ...
