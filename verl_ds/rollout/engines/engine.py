"""The one interface the loop uses of a rollout engine. `VLLMRollout` and `HFRollout` implement all of
it (tests/rollout/test_engine_choice.py checks the members and their signatures), so callers never
probe an engine for what it has."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Protocol, runtime_checkable

import torch

from ..batch import RolloutBatch


@dataclass
class Sampled:
    """One stream request's sample as far as it got: `finish` stop | length (it ended), or abort (the
    stream closed first)."""

    key: Any
    ids: list[int]
    logprobs: list[float]
    finish: str


class TokenStream(Protocol):
    """Requests an engine advances step by step, for partial rollouts: a step stops as soon as it can
    train, and what is still running is cut there keeping every token it sampled (step-and-abort)."""

    steps: int  # decode steps run so far (per step: its longest new output)
    peak: int  # the most samples it ran at once so far

    def add(self, keys: list, context: list[int], max_new_tokens: int, seed: int) -> None:
        """`len(keys)` samples continuing `context` (ids), sample j seeded `seed + j` (vLLM's own rule
        for a request's n samples), each up to `max_new_tokens` new tokens."""
        ...

    def step(self) -> list[Sampled]:
        """Advance every running request; -> the samples that ended."""
        ...

    def close(self) -> list[Sampled]:
        """End the stream: -> the samples still running, as far as they got (finish "abort")."""
        ...

    def __len__(self) -> int:
        """Samples still running."""
        ...


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
        top_k: int = 0,
    ) -> RolloutBatch:
        """`n` samples per prompt, contiguous per prompt; `seeds[i]` seeds prompt i's samples. Each
        token is sampled from `algos.TokenDist(temperature, top_k, top_p)` and its logprob is of that
        (processed) distribution."""
        ...

    def stream(self, temperature: float, top_p: float, chunk_tokens: int, top_k: int = 0) -> TokenStream:
        """A `TokenStream` (one open at a time, closed before the next `generate`): vLLM steps its
        engine one token at a time; HF generate runs `chunk_tokens` a step, re-sending the contexts."""
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
