"""`RunSetup`: what one run derives from its config, derived once at the start of `RLTrainer.__init__`
(`resolve_setup`) and read by everything after it: the builder, the loop, the programs. Nothing
else re-derives these facts (the process group, the rollout engine, the device, the precision, the
roles and their DeepSpeed configs, the names the run resolves, the world, the mini-batch, the
checkpoint to resume from)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Mapping

from verl_ds.algos import TokenDist
from verl_ds.checkpoint import pick_resume, probe_writable, resumed_step
from verl_ds.config import RunConfig, batches, default_world, read_ds_files, resolve_names, validate_paths
from verl_ds.diagnostics.memory.budget import fit_memory
from verl_ds.dist import bind_device, init_distributed, on_gpu, rank, world_size
from verl_ds.errors import RunFailure, raise_all
from verl_ds.precision import (
    TRAINED_ROLES,
    MismatchGate,
    ResolvedPrecision,
    resolve_for_files,
    resolve_gate,
    resolve_sync_check,
)
from verl_ds.preflight import preflight
from verl_ds.process import allocator
from verl_ds.roles import attention as attn
from verl_ds.roles import prefix
from verl_ds.rollout import resolve_eager

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunSetup:
    """The facts of one run, each derived once (`resolve_setup`)."""

    cfg: RunConfig  # as given, with `rollout.engine` resolved (vllm | hf)
    gpu: bool  # `dist.on_gpu()`: the engines run on this rank's GPU
    rank: int
    world: int
    precision: ResolvedPrecision  # `auto` met the hardware and the roles' JSON files
    roles: tuple[str, ...]  # the active roles (`config.active_roles`)
    trained: tuple[str, ...]  # those with an optimizer
    ds: Mapping[str, dict]  # each active role's DeepSpeed config, as its engine receives it
    token_budgets: Mapping[str, int]  # each active role's tokens per micro-batch (`config.token_budget`)
    attention: str  # the policy models' attention implementation (`resolve_attention`)
    packing: bool  # the policy models' passes run padding-free rows (`resolve_attention`)
    share_prefixes: bool  # every role's passes run a prefix its rows share once (`resolve_sharing`)
    share_min_tokens: int  # ... where that saves at least this many tokens a row (`prefix.min_saved_tokens`)
    sampled: TokenDist  # what the rollout samples each token from, and every pass scores it under (`resolve_sampled`)
    gate: MismatchGate  # the bound on the rollout-vs-trainer mismatch (`precision.resolve_gate`)
    sync_check: str  # rows (the step's first scoring, free) | probe | stream (`precision.resolve_sync_check`)
    tools: tuple[Callable, ...]  # `data.tools`
    env_factory: Callable | None  # `rollout.multi_turn.env`; None: no environment
    agent: Callable | None  # `rollout.multi_turn.agent`; None: not an agent job
    reward_fn: Callable  # `data.reward_fn` (or the caller's)
    mini_rows: int  # this rank's rows per mini-batch; 0: all of them (`trainer.mini_batch_size: 0`)
    resume_from: Path | None  # the intact checkpoint `trainer.resume` names (None: a fresh start)
    resume_step: int  # the step it was written after (0: a fresh start)
    rank_memory: float = 0.0  # bytes one rank may use (`rank_budget`)
    memory_estimate: Mapping[str, float] = field(default_factory=dict)  # the memory model's bytes per stage, one rank


def resolve_setup(cfg: RunConfig, reward_fn: Callable | None = None) -> RunSetup:
    """(Long on purpose: one fact a line, each after the ones it needs; docs/ARCHITECTURE.md, "One run setup".)
    The run's facts in dependency order, each from the module that owns it: the device and the log
    levels; the config against its models (`preflight`, what `config render` checks too: the engine,
    the sampled distribution, the policy's shape); what the config gives alone (every active role's
    DeepSpeed JSON, read once; its paths; its batch arithmetic on the launch's ranks; its names); the
    precision and what the pair promises (the mismatch gate, the sync check); the process group, once
    nothing in the config is refused; the run's directory and the checkpoint to resume from; the
    attention and prefix sharing; and this rank's memory (budget, ZeRO stages, the rendered configs,
    token budgets).
    Nothing is made here: the model, the data and the engines are the builder's (`builder.build`)."""
    gpu = on_gpu()
    bind_device()  # this rank's GPU before any CUDA call (the precision's hardware facts)
    say_start(cfg, gpu)  # the log levels by rank first: every start-up line after this is said once
    sampling = preflight(cfg, gpu)  # the config against its models, rollout.engine auto -> vllm | hf
    # before the roles' ZeRO budget (vLLM holds GPU memory); rollout.enforce_eager auto: compiled on a GPU
    eager = resolve_eager(cfg.rollout.enforce_eager, gpu)
    cfg = replace(cfg, rollout=replace(cfg.rollout, engine=sampling.engine, enforce_eager=eager))
    # what the config gives alone: its DeepSpeed JSONs (one per active role), its paths, its batch
    # arithmetic on the launch's trainer ranks, the names it resolves
    files = read_ds_files(cfg)
    validate_paths(cfg)
    world = default_world(cfg)
    batch = batches(cfg, world)
    names, errors = resolve_names(cfg)  # validation resolved them too: a cfg not from load_config
    raise_all(errors)
    trained = tuple(r for r in files if r in TRAINED_ROLES)
    # the one place `auto` meets the hardware (and the roles' JSON files' fp16/bf16 blocks); the pair's
    # promise (the mismatch gate's bound) and how each sync is checked follow from its dtypes
    precision = resolve_for_files(cfg.precision, cfg.trainer.device, files)
    stale = cfg.rollout.partial.enabled and cfg.rollout.partial.max_staleness > 0
    apart = cfg.trainer.rollout_ranks > 0
    a = cfg.algorithm
    gate = resolve_gate(a.mismatch_gate, a.mismatch_gate_fraction, precision.actor, precision.rollout, stale, apart)
    sync_check = resolve_sync_check(precision.actor, precision.rollout, sampling.dist.truncates, stale, apart)
    # the process group once nothing in the config is refused (this kind's, where rollout ranks run apart)
    init_distributed(cfg.trainer.collective_timeout_s, cfg.trainer.rollout_ranks)
    me = rank()
    if world_size() != world:  # the launch's env said one world, the group formed another
        raise RunFailure(f"the process group holds {world_size()} trainer ranks, the launch's env {world}")
    # the run's directory writable and the checkpoint to resume from checked whole (nothing made: a
    # refused run leaves none), with the step it was written after
    checkpoints = Path(cfg.trainer.run_dir) / "checkpoints"
    probe_writable(checkpoints, "trainer.run_dir")
    t = cfg.trainer
    resume_from = pick_resume(checkpoints, t.resume, trained, world, t.sequence_parallel_size, t.rollout_ranks)
    resume_step = resumed_step(resume_from) if resume_from is not None else 0
    # how the policy's passes attend, and whether they share prefixes (from how many tokens: the actor's dtype)
    attention, packing = attn.resolve(cfg.model.attn_implementation, cfg.model.packing, gpu)
    share_prefixes, share_min_tokens = prefix.resolve_sharing(cfg, attention, precision.actor)
    memory = fit_memory(cfg, sampling.shape, files, precision, world, gpu, batch, share_prefixes)
    return RunSetup(
        cfg=cfg,
        gpu=gpu,
        rank=me,
        world=world,
        precision=precision,
        roles=tuple(files),
        trained=trained,
        ds=memory.ds,
        token_budgets=memory.token_budgets,
        attention=attention,
        packing=packing,
        share_prefixes=share_prefixes,
        share_min_tokens=share_min_tokens,
        sampled=sampling.dist,
        gate=gate,
        sync_check=sync_check,
        tools=names.tools,
        env_factory=names.env_factory,
        agent=names.agent,
        reward_fn=reward_fn or names.reward_fn,
        mini_rows=cfg.trainer.mini_batch_size // batch.dp_world,  # a SP group's ranks hold its rows
        resume_from=resume_from,
        resume_step=resume_step,
        rank_memory=memory.budget,
        memory_estimate=memory.estimate,
    )


def say_start(cfg: RunConfig, gpu: bool) -> None:
    """The log levels by rank (the launch's, before the process group forms: trainer rank 0 is the launch's
    rank 0): rank 0 logs at `logging.level`, the others only warnings, so every start-up line after this is
    said once; then the device and the allocator, once."""
    me = int(os.environ.get("RANK", "0"))
    logging.getLogger("verl_ds").setLevel(cfg.logging.level if me == 0 else logging.WARNING)
    if cfg.trainer.device == "cpu" and gpu:
        log.warning(
            "trainer.device: cpu sets the precision rule only; the engines run on the GPU "
            "(hide it to train on the CPU: CUDA_VISIBLE_DEVICES=)"
        )
    if not gpu:
        malloc = allocator()
        hint = " (CPU steps take ~1.25x the time: launch/train.sh preloads libtcmalloc-minimal4 where installed)"
        log.info("memory allocator: %s%s", malloc, hint if malloc == "glibc" else "")
