"""Rollout across ranks: every rank owns an engine; tensor-parallel groups share one.

A group of `tensor_parallel_size` consecutive ranks runs one vLLM engine whose members must send
identical requests: the group's prompts (and their seeds) are all-gathered as tensors, every member
generates the whole group batch, and each keeps its own prompts' samples. With TP = 1 (and for HF
generate) a rank generates its own prompts and nothing moves.
"""

from __future__ import annotations

import logging
from typing import Iterable

import torch

from verl_ds import dist as vdist
from verl_ds.dist import on_gpu
from verl_ds.errors import ConfigError

from ..batch import RolloutBatch
from ..seeding import prompt_seeds
from .engine import RolloutEngine

log = logging.getLogger(__name__)


# `rollout.engine: auto` on CPU: below this many parameters HF generate samples faster than vLLM,
# whose per-sequence scheduling and output bookkeeping (Python, every engine step) outweighs so small
# a model's compute. Where the crossover lies was measured with `verl-ds bench rollout`
# (docs/BENCHMARKS.md, "Which rollout engine": the tokens/s ratios by model size).
AUTO_HF_MAX_PARAMS = 2_000_000


def choose_engine(requested: str, params: int, cuda: bool, sequence_parallel: int = 1) -> tuple[str, str]:
    """(engine, why) for `rollout.engine` = vllm | hf | auto: auto is vLLM on a GPU, under sequence
    parallelism (the HF engine would generate with the actor's model, whose attention SP replaces) and on
    CPU for models of AUTO_HF_MAX_PARAMS or more, HF generate for smaller ones on CPU."""
    if requested != "auto":
        return requested, "as configured"
    if cuda:
        return "vllm", "GPU"
    if sequence_parallel > 1:
        return "vllm", f"trainer.sequence_parallel_size {sequence_parallel}: the HF engine runs the actor's split model"
    if params < AUTO_HF_MAX_PARAMS:
        return "hf", (
            f"{params / 1e6:.2f}M params on CPU: below {AUTO_HF_MAX_PARAMS / 1e6:.0f}M HF generate "
            "samples faster than vLLM; rollout.engine=vllm forces vLLM"
        )
    return "vllm", f"{params / 1e6:.1f}M params on CPU"


def resolve_engine(rollout_cfg, params: int, gpu: bool, sequence_parallel: int = 1) -> str:
    """The engine this run samples with (`params`: the policy model's): `choose_engine`, then HF generate
    where vLLM is not importable, except under sequence parallelism, which needs vLLM (a ConfigError)."""
    engine, why = choose_engine(rollout_cfg.engine, params, gpu, sequence_parallel)
    if rollout_cfg.engine == "auto":
        log.info("rollout.engine auto -> %s (%s)", engine, why)
    if engine == "vllm":
        try:
            import vllm  # noqa: F401
        except ImportError as e:
            if sequence_parallel > 1:
                raise ConfigError(
                    "rollout.engine", f"trainer.sequence_parallel_size {sequence_parallel} needs vLLM: {e}"
                ) from None
            log.warning("rollout.engine=vllm but vllm is not importable (%s): falling back to HF generate", e)
            engine = "hf"
    return engine


def resolve_eager(enforce_eager, gpu: bool) -> bool:
    """`rollout.enforce_eager` as vLLM takes it. auto: compiled with CUDA graphs on a GPU (vLLM's own
    default; eager decoding there launches every kernel from Python), eager on CPU, where compiling
    costs more at start than a short run's generation saves (docs/BENCHMARKS.md)."""
    return (not gpu) if enforce_eager == "auto" else bool(enforce_eager)


def make_rollout(
    rollout_cfg, model_path: str, dtype: str, seed: int, trust_remote_code: bool = False, lm_head_fp32: bool = False
) -> RolloutEngine:
    """This rank's rollout engine, `rollout_cfg.engine` (vllm | hf) as `resolve_engine` settled it."""
    from .hf_rollout import HFRollout

    if rollout_cfg.engine not in ("vllm", "hf"):
        raise ValueError(f"rollout.engine {rollout_cfg.engine!r}: resolve it first (resolve_engine)")
    if rollout_cfg.engine == "hf":
        device = f"cuda:{torch.cuda.current_device()}" if on_gpu() else "cpu"
        return HFRollout(
            model_path, dtype, device=device, trust_remote_code=trust_remote_code, lm_head_fp32=lm_head_fp32
        )
    from .vllm_rollout import VLLMRollout

    return VLLMRollout(
        model_path,
        dtype,
        tensor_parallel_size=rollout_cfg.tensor_parallel_size,
        max_model_len=rollout_cfg.max_model_len,
        kv_cache_gb=rollout_cfg.kv_cache_gb,
        gpu_memory_utilization=rollout_cfg.gpu_memory_utilization,
        enforce_eager=resolve_eager(rollout_cfg.enforce_eager, on_gpu()),  # the setup's value, or auto's
        bucket_mb=rollout_cfg.bucket_mb,
        block_size=rollout_cfg.block_size,
        seed=seed,
        sleep=rollout_cfg.sleep,
        trust_remote_code=trust_remote_code,
        lm_head_fp32=lm_head_fp32,
    )


def prompt_positions(n_local: int, round_: int = 0, rank: int | None = None, world: int | None = None) -> range:
    """Global positions of this rank's `n_local` prompts: prompt i of rank r in generation round k
    of a step (dynamic sampling may need several) sits at (k * world + r) * n_local + i. `rank`,
    `world`: another rank's (a rollout rank apart generates for its trainer ranks); default this one's."""
    rank = vdist.rank() if rank is None else rank
    world = vdist.world_size() if world is None else world
    start = (round_ * world + rank) * n_local
    return range(start, start + n_local)


def generate_distributed(
    rollout: RolloutEngine,
    local_prompt_ids: list[list[int]],
    n: int,
    temperature: float,
    top_p: float,
    max_new_tokens: int,
    run_seed: int,
    step: int | str,
    round_: int = 0,
    seeds: list[int] | None = None,
    top_k: int = 0,
) -> RolloutBatch:
    """Samples for this rank's prompts (`group_ids` index the local prompts), each prompt seeded
    from (run_seed, step, its `prompt_positions` entry), or with `seeds` given (later turns of
    multi-turn episodes). Collective within a tensor-parallel group: every member must call it."""
    args = dict(n=n, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, top_k=top_k)
    if seeds is None:
        seeds = prompt_seeds(run_seed, step, prompt_positions(len(local_prompt_ids), round_))
    tp = rollout.tp
    if tp == 1:
        return rollout.generate(local_prompt_ids, **args, seeds=seeds)
    prompts, all_seeds, offset = _gather_group(local_prompt_ids, seeds, tp)
    batch = rollout.generate(prompts, **args, seeds=all_seeds)
    mine = ((batch.group_ids >= offset) & (batch.group_ids < offset + len(local_prompt_ids))).nonzero().flatten()
    part = batch.select(mine)
    part.group_ids -= offset
    return part


def _gather_group(prompts: list[list[int]], seeds: list[int], tp: int) -> tuple[list[list[int]], list[int], int]:
    """All prompts and seeds of this rank's TP group in rank order, and where this rank's start.
    Two tensor all-gathers (sizes, then rows of [length, seed, tokens...]); no pickling."""
    import torch.distributed as dist

    group, members = vdist.tp_group(tp)
    sizes = vdist.device_tensor([len(prompts), max((len(p) for p in prompts), default=0)], torch.long)
    all_sizes = [torch.empty_like(sizes) for _ in members]
    dist.all_gather(all_sizes, sizes, group=group)
    counts = [int(s[0]) for s in all_sizes]
    width = 2 + max(int(s[1]) for s in all_sizes)
    rows = torch.zeros(max(counts), width, dtype=torch.long)
    for i, (p, s) in enumerate(zip(prompts, seeds)):
        rows[i, 0], rows[i, 1] = len(p), s
        rows[i, 2 : 2 + len(p)] = torch.as_tensor(p, dtype=torch.long)
    rows = rows.to(sizes.device)
    gathered = [torch.empty_like(rows) for _ in members]
    dist.all_gather(gathered, rows, group=group)
    out_p, out_s = [], []
    for c, g in zip(counts, gathered):
        for row in g[:c].cpu().tolist():
            out_p.append(row[2 : 2 + row[0]])
            out_s.append(row[1])
    me = members.index(vdist.rank())
    return out_p, out_s, sum(counts[:me])


class GroupLeader:
    """A tensor-parallel group's first rank generating for the whole group (the agent endpoint, whose
    requests arrive one HTTP call at a time on that rank alone): each `generate` is first broadcast to
    the group's other members, which take part in the same engine call through `follow`. `release()`
    ends their following. It has the engine's `generate`, `pad_id` and `tp`: what an `AgentServer`
    generates with."""

    def __init__(self, engine: RolloutEngine):
        self.engine, self.tp, self.pad_id = engine, engine.tp, engine.pad_id
        self.group, self.members = vdist.tp_group(engine.tp)

    @property
    def last_metrics(self) -> dict[str, float]:
        return self.engine.last_metrics

    def generate(self, prompt_token_ids, n=1, temperature=1.0, top_p=1.0, max_new_tokens=16, seeds=None, top_k=0):
        args = dict(n=n, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, seeds=seeds, top_k=top_k)
        _broadcast(self, {"prompt_token_ids": prompt_token_ids, **args})
        return self.engine.generate(prompt_token_ids, **args)

    def release(self) -> None:
        _broadcast(self, None)


def _broadcast(leader: GroupLeader, message: dict | None) -> None:
    import torch.distributed as dist

    dist.broadcast_object_list([message], src=leader.members[0], group=leader.group)


def follow(engine: RolloutEngine) -> int:
    """A tensor-parallel group member's side of `GroupLeader`: generate what the leader generates,
    until it releases the group. The number of engine calls taken part in."""
    import torch.distributed as dist

    group, members = vdist.tp_group(engine.tp)
    calls = 0
    while True:
        message = [None]
        dist.broadcast_object_list(message, src=members[0], group=group)
        if message[0] is None:
            return calls
        engine.generate(**message[0])
        calls += 1


def sync_distributed(rollout: RolloutEngine, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
    """Push new weights into this rank's engine. The whole iterator is consumed even after the
    engine refused a tensor (under ZeRO-3 each module's gather is collective): the error is raised
    once it is drained, so the other ranks are not left waiting in a gather."""
    it = iter(named_tensors)
    try:
        return rollout.sync_weights(it)
    except Exception:
        for _ in it:
            pass
        raise
