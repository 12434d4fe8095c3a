"""Rollout across ranks: who owns an engine, how prompts and samples move, how weights are synced.

Two layouts. Rank-0 mode (default for vLLM): rank 0 owns the only engine; every rank's prompts are
gathered there and each rank gets its own prompts' samples back. Per-rank mode (`per_rank`, and
always for HF): each rank generates its own prompts locally.
"""
from __future__ import annotations

import logging
import os
from typing import Iterable

import torch

from .batch import RolloutBatch

log = logging.getLogger(__name__)


def _dist():
    import torch.distributed as dist
    return dist if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 else None


def _cpu_bind_for_rank(rank: int, world_size: int) -> str | None:
    """Disjoint core ranges per rank, else every engine's OpenMP threads pin core 0 (PLATFORM.md)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    per = max(1, len(cores) // world_size)
    mine = cores[rank * per:(rank + 1) * per] or cores[-1:]
    return ",".join(map(str, mine))


def make_rollout(rollout_cfg, model_path: str, dtype: str, rank: int, world_size: int, seed: int,
                 trust_remote_code: bool = False):
    """The rollout this rank owns, or None (rank-0 mode, rank > 0)."""
    from .hf_rollout import HFRollout

    engine = rollout_cfg.engine
    if engine == "vllm":
        try:
            import vllm  # noqa: F401
        except ImportError as e:
            log.warning("rollout.engine=vllm but vllm is not importable (%s): falling back to HF generate", e)
            engine = "hf"
    if engine == "hf":
        device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
        return HFRollout(model_path, dtype, device=device, seed=seed + rank, trust_remote_code=trust_remote_code)
    if engine != "vllm":
        raise ValueError(f"rollout.engine: unknown engine {engine!r} (vllm | hf)")
    if world_size > 1 and not rollout_cfg.per_rank and not rollout_cfg.multiprocess:
        from verl_ds.errors import ConfigError
        raise ConfigError("rollout.multiprocess", "in-process vLLM (multiprocess: false) with only rank 0 "
                          "owning the engine deadlocks inside LLM() (it joins the trainer's process group); "
                          "set rollout.per_rank: true or rollout.multiprocess: true")
    if world_size > 1 and not rollout_cfg.per_rank and rank != 0:
        return None
    from .vllm_rollout import VLLMRollout

    shared = world_size > 1 and not rollout_cfg.per_rank
    bind = None
    if not torch.cuda.is_available() and rollout_cfg.per_rank and world_size > 1:
        bind = _cpu_bind_for_rank(rank, world_size)
    rollout = VLLMRollout(
        model_path, dtype, max_model_len=rollout_cfg.max_model_len, kv_cache_gb=rollout_cfg.kv_cache_gb,
        enforce_eager=rollout_cfg.enforce_eager, multiprocess=rollout_cfg.multiprocess,
        bucket_mb=rollout_cfg.bucket_mb, seed=seed + (rank if rollout_cfg.per_rank else 0),
        gpu_memory_utilization=rollout_cfg.gpu_memory_utilization, cpu_threads_bind=bind,
        trust_remote_code=trust_remote_code)
    rollout.serves_all_ranks = shared   # generate_distributed gathers every rank's prompts here
    return rollout


def generate_distributed(rollout, local_prompt_ids: list[list[int]], n: int, temperature: float,
                         top_p: float, max_new_tokens: int, seed: int | None = None) -> RolloutBatch:
    """Samples for this rank's prompts (group_ids index the local prompts). Collective in rank-0
    mode (rank 0's rollout has `serves_all_ranks`, other ranks pass None): every rank must call it."""
    args = dict(n=n, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens)
    dist = _dist()
    if dist is None or (rollout is not None and not getattr(rollout, "serves_all_ranks", False)):
        return rollout.generate(local_prompt_ids, **args, seed=seed)   # world 1, or per-rank mode
    rank, world = dist.get_rank(), dist.get_world_size()
    gathered = [None] * world if rank == 0 else None
    dist.gather_object([list(map(int, p)) for p in local_prompt_ids], gathered, dst=0)
    parts = [None] * world if rank == 0 else None
    if rank == 0:
        counts = [len(g) for g in gathered]
        if rollout is None:
            raise RuntimeError("generate_distributed: rank 0 has no rollout engine")
        batch = rollout.generate([p for g in gathered for p in g], **args, seed=seed)
        parts, start = [], 0
        for c in counts:      # samples of prompt j are rows with group_ids == j, contiguous
            sel = ((batch.group_ids >= start) & (batch.group_ids < start + c)).nonzero().flatten()
            part = batch.select(sel)
            part.group_ids -= start
            parts.append(part)
            start += c
    out = [None]
    dist.scatter_object_list(out, parts, src=0)
    return out[0]


def sync_distributed(rollout, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
    """Push new weights into this rank's engine. Every rank consumes the whole iterator (under
    ZeRO-3 each module's gather is collective), even a rank without an engine, and even after
    the engine refused a tensor: the error is raised only once the iterator is drained, so the
    other ranks are not left waiting in a gather."""
    if rollout is None:
        for _ in named_tensors:
            pass
        return {}
    it = iter(named_tensors)
    try:
        return rollout.sync_weights(it)
    except Exception:
        for _ in it:
            pass
        raise
