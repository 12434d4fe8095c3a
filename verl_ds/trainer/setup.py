"""`RunSetup`: what one run derives from its config, derived once at the start of `RLTrainer.__init__`
(`resolve_setup`) and read by everything after it: the builder, the loop, the programs. Nothing
else re-derives these facts (the process group, the model path, the rollout engine, the device, the
precision, the roles and their DeepSpeed configs, the names the run resolves, the world, the
mini-batch, the checkpoint to resume from)."""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Callable, Mapping

from verl_ds.algos import TokenDist
from verl_ds.config import (
    RunConfig,
    dp_world,
    longest_row,
    resolve_names,
    sequence_parallel_says,
    token_budget,
    validate_paths,
)
from verl_ds.data.tiny import prepare_model
from verl_ds.diagnostics.memory import (
    BYTES,
    ModelShape,
    choose_zero_stages,
    estimate_memory,
    fit_passes,
    load_shape,
    role_shapes,
    rollout_memory,
    stage_totals,
    workload,
)
from verl_ds.dist import init_distributed, on_gpu, rank, world_size
from verl_ds.ds_config import read_ds_files, render_ds_configs, run_precision
from verl_ds.errors import ConfigError, raise_all
from verl_ds.precision import TRAINED_ROLES, ResolvedPrecision
from verl_ds.preflight import preflight
from verl_ds.process import allocator
from verl_ds.roles import attention, prefix
from verl_ds.rollout import resolve_eager
from verl_ds.trainer.checkpoint import pick_resume, probe_writable
from verl_ds.trainer.consistency import MismatchGate, resolve_gate
from verl_ds.trainer.probe import resolve_sync_check

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunSetup:
    """The facts of one run, each derived once (`resolve_setup`)."""

    cfg: RunConfig  # as given, with `rollout.engine` resolved (vllm | hf)
    model_path: str  # `model.path`, or the tiny model built under the run dir
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
    gate: MismatchGate  # the bound on the rollout-vs-trainer mismatch (`consistency.resolve_gate`)
    sync_check: str  # rows (the step's first scoring, free) | probe (`probe.resolve_sync_check`)
    tools: tuple[Callable, ...]  # `data.tools`
    env_factory: Callable | None  # `rollout.multi_turn.env`; None: no environment
    agent: Callable | None  # `rollout.multi_turn.agent`; None: not an agent job
    reward_fn: Callable  # `data.reward_fn` (or the caller's)
    mini_rows: int  # this rank's rows per mini-batch; 0: all of them (`trainer.mini_batch_size: 0`)
    resume_from: Path | None  # the intact checkpoint `trainer.resume` names (None: a fresh start)
    rank_memory: float = 0.0  # bytes one rank may use (`rank_budget`)
    memory_estimate: Mapping[str, float] = field(default_factory=dict)  # the memory model's bytes per stage, one rank


def resolve_setup(cfg: RunConfig, reward_fn: Callable | None = None) -> RunSetup:
    """(Long on purpose: one fact a line, each after the ones it needs; docs/ARCHITECTURE.md, "One run setup".)
    The run's facts, each after the ones it needs, what the config alone decides first: every
    active role's DeepSpeed JSON (read once), the paths, token budgets and names the config gives;
    then the process group (rank and world), the precision, the model (a teacher's tokenizer checked
    against it), the engine, the batch checked against this rank's memory, the configs rendered (with
    `zero_stage: auto` chosen), and last the checkpoint to resume from."""
    files = read_ds_files(cfg)  # one per active role
    validate_paths(cfg)
    token_budgets = {r: token_budget(cfg, r) for r in files}
    names, errors = resolve_names(cfg)  # validation resolved them too: a cfg not from load_config
    raise_all(errors)
    init_distributed(cfg.trainer.collective_timeout_s)
    me, world, gpu = rank(), world_size(), on_gpu()
    # rank 0 logs at logging.level; other ranks only warnings
    logging.getLogger("verl_ds").setLevel(cfg.logging.level if me == 0 else logging.WARNING)
    if cfg.trainer.device == "cpu" and gpu:
        log.warning(
            "trainer.device: cpu sets the precision rule only; the engines run on the GPU "
            "(hide it to train on the CPU: CUDA_VISIBLE_DEVICES=)"
        )
    if not gpu:  # other ranks log warnings only
        malloc = allocator()
        hint = " (CPU steps take ~1.25x the time: launch/train.sh preloads libtcmalloc-minimal4 where installed)"
        log.info("memory allocator: %s%s", malloc, hint if malloc == "glibc" else "")
    precision = run_precision(cfg, files=files)  # the one place `auto` meets the hardware
    attention, packing = resolve_attention(cfg.model.attn_implementation, cfg.model.packing, gpu)
    share_prefixes, share_min_tokens = resolve_sharing(cfg, attention, precision.actor)
    # the config against its models (`config render` runs the same), rollout.engine auto -> vllm | hf before
    # the roles' ZeRO budget (vLLM holds GPU memory); rollout.enforce_eager auto -> compiled on a GPU, eager on CPU
    engine, eager = preflight(cfg, gpu), resolve_eager(cfg.rollout.enforce_eager, gpu)
    cfg = replace(cfg, rollout=replace(cfg.rollout, engine=engine, enforce_eager=eager))
    if said := sequence_parallel_says(cfg):
        log.info(said)
    model_path = prepare_model(cfg.model, cfg.trainer.run_dir)
    sampled = resolve_sampled(cfg)
    trained = tuple(r for r in files if r in TRAINED_ROLES)
    sleepers = [r for r in trained if getattr(cfg.roles, r).sleep]
    if sleepers and not gpu:
        log.info("roles.{%s}.sleep: a no-op on CPU (no device memory to hand to the rollout)", ",".join(sleepers))
    offloaders = ",".join(r for r in trained if getattr(cfg.roles, r).offload_activations)
    if offloaders and not gpu:
        log.info(
            "roles.{%s}.offload_activations: a no-op on CPU (activations are in host memory)", ",".join(offloaders)
        )
    budget, shape = rank_budget(cfg, world, gpu), load_shape(model_path)
    check_batch_fits(cfg, shape, precision, world, gpu, budget)
    stages = zero_stages(cfg, shape, files, precision, world, budget)
    ds = render_ds_configs(cfg, world, precision, stages, files)
    token_budgets = fit_token_budgets(cfg, shape, ds, precision, world, gpu, budget, token_budgets)
    gpu_gib = budget / 2**30 if gpu else None
    estimate = stage_totals(estimate_memory(cfg, shape, dict(ds), world, precision.rollout, gpu_gib, role_shapes(cfg)))
    # last, once the config's own mistakes are refused (a refused run leaves no checkpoints dir): the
    # run's directories writable and the checkpoint to resume from checked whole, before any engine
    checkpoints = Path(cfg.trainer.run_dir) / "checkpoints"
    probe_writable(checkpoints, "trainer.run_dir")
    resume_from = pick_resume(checkpoints, cfg.trainer.resume, trained, world, cfg.trainer.sequence_parallel_size)
    return RunSetup(
        cfg=cfg,
        model_path=model_path,
        gpu=gpu,
        rank=me,
        world=world,
        precision=precision,
        roles=tuple(files),
        trained=trained,
        ds=MappingProxyType(ds),
        token_budgets=MappingProxyType(token_budgets),
        attention=attention,
        packing=packing,
        share_prefixes=share_prefixes,
        share_min_tokens=share_min_tokens,
        sampled=sampled,
        gate=resolve_gate(cfg, precision.actor, precision.rollout),
        sync_check=resolve_sync_check(cfg, precision.actor, precision.rollout, sampled),
        tools=names.tools,
        env_factory=names.env_factory,
        agent=names.agent,
        reward_fn=reward_fn or names.reward_fn,
        mini_rows=cfg.trainer.mini_batch_size // dp_world(cfg, world),  # a SP group's ranks hold its rows
        resume_from=resume_from,
        rank_memory=budget,
        memory_estimate=MappingProxyType(estimate),
    )


def resolve_attention(attn: str, packing, gpu: bool) -> tuple[str, bool]:
    """`model.attn_implementation` and `model.packing` resolved: flash-attention where it runs (a GPU
    and the flash-attn package), SDPA on other GPUs, on CPU SDPA with the plain math for 16-bit
    backward passes (roles/attention.py), and packed rows where the attention runs them without a mask
    (flash-attention's varlen kernels skip what lies between rows; SDPA's masked pack runs it, which
    measured slower than padded rows under token budgets on CPU, docs/BENCHMARKS.md)."""
    has_flash = gpu and importlib.util.find_spec("flash_attn") is not None
    if attn == "auto":
        attn = "flash_attention_2" if has_flash else "sdpa" if gpu else attention.NAME
    elif attn == "flash_attention_2" and not has_flash:
        raise ConfigError(
            "model.attn_implementation",
            "flash_attention_2 needs a CUDA GPU and the flash-attn package (pip install flash-attn); "
            "auto or sdpa run without it",
        )
    return attn, attn == "flash_attention_2" if packing == "auto" else bool(packing)


def resolve_sharing(cfg: RunConfig, attention_: str, actor_dtype: str) -> tuple[bool, int]:
    """Whether the roles' passes share prefixes (`roles/prefix.py`), and from how many tokens saved a row
    (`prefix.min_saved_tokens`), said in one line: `model.share_prompt`, where the policy models' attention
    takes the prefix mask (varlen flash-attention cannot) and rows run whole (under sequence parallelism a
    row is split over its group and runs alone)."""
    m, sp = cfg.model, cfg.trainer.sequence_parallel_size
    why = (
        "model.share_prompt is false"
        if not m.share_prompt
        else f"{attention_} cannot take a prefix mask (use sdpa or flex_attention)"
        if attention_ not in prefix.SUPPORTED
        else f"trainer.sequence_parallel_size {sp}: each row runs alone, split over its group"
        if sp > 1
        else ""
    )
    min_saved = prefix.min_saved_tokens(m.share_prefix_min_tokens, actor_dtype)
    if why:
        log.info("shared prefixes: off (%s)", why)
        return False, min_saved
    log.info(
        "shared prefixes: on (a micro-batch's rows run each prefix they share once, in every role's passes, "
        "where that saves at least %d tokens a row%s and its cost model says it pays)",
        min_saved,
        f" ({actor_dtype} actor)" if m.share_prefix_min_tokens == "auto" else "",
    )
    return True, min_saved


def resolve_sampled(cfg: RunConfig) -> TokenDist:
    """The distribution the rollout samples from (`algos.TokenDist`), which every policy pass scores
    its tokens under; a truncated one said in one line, with where its kept set comes from."""
    r = cfg.rollout
    dist = TokenDist(r.temperature, r.top_k, r.top_p)
    if dist.truncates:
        log.info(
            "sampling: top_k %d, top_p %g: every pass scores a token under the renormalised set the %s engine "
            "sampled it from, that set recomputed from the pass's own logits by the engine's rule (exact for a "
            "matched pair; vLLM's returned sampling mask needs its GPU model runner and is not read)",
            r.top_k,
            r.top_p,
            r.engine,
        )
    return dist


def rank_budget(cfg: RunConfig, world: int, gpu: bool) -> float:
    """The bytes one rank may use: `trainer.rank_memory_gb`, or its GPU (less vLLM's share when vLLM
    keeps it while the roles train), or this node's RAM (its cgroup's limit, where lower) over the
    ranks on it."""
    if cfg.trainer.rank_memory_gb != "auto":
        return float(cfg.trainer.rank_memory_gb) * 2**30
    if gpu:
        import torch

        budget = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        if not cfg.rollout.sleep and cfg.rollout.engine == "vllm":
            budget *= 1 - cfg.rollout.gpu_memory_utilization  # vLLM keeps its share while training
        return budget
    import psutil

    return min(psutil.virtual_memory().total, _cgroup_limit()) / int(os.environ.get("LOCAL_SIZE", world))


def _cgroup_limit() -> float:
    """This process's cgroup memory limit (v2 `memory.max`, v1 `memory.limit_in_bytes`), inf if none."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        return float(text) if text.isdigit() else float("inf")
    return float("inf")


def check_batch_fits(
    cfg: RunConfig, shape: ModelShape, precision: ResolvedPrecision, world: int, gpu: bool, budget: float
) -> None:
    """Refuse, before any engine, a rollout batch whose own buffers (the `debug memory` estimate of its
    ids, masks and logprobs, and HF generate's cache) exceed this rank's memory whatever the ZeRO
    stage: `rollout.n: 1000000000` is one line now, not a MemoryError or the OOM killer later."""
    w, dtype = workload(cfg, world), precision.rollout
    weights = shape.params("lm") * BYTES[dtype]  # only the rollout stage's batch terms are read below
    gen = rollout_memory(shape, cfg.rollout, dtype, w, 0.0, budget / 2**30 if gpu else None, weights)["rollout"]
    need = gen.get("logits_buffer", 0.0) + (gen.get("kv_cache", 0.0) if cfg.rollout.engine == "hf" else 0.0)
    if need > budget:
        raise ConfigError(
            "rollout.n",
            f"trainer.prompts_per_step x rollout.n = {cfg.trainer.prompts_per_step * cfg.rollout.n:,} rows "
            f"({w.gen_batch:,} per engine) of up to {w.seq_len} tokens need ~{need / 2**30:,.1f} GiB to generate, "
            f"over this rank's {budget / 2**30:,.1f} GiB: lower rollout.n, trainer.prompts_per_step or "
            "rollout.max_new_tokens",
        )


HEADROOM = 0.8  # of a rank's memory the memory model may plan for (it is an estimate)


def fit_token_budgets(
    cfg: RunConfig,
    shape: ModelShape,
    ds: Mapping[str, dict],
    precision: ResolvedPrecision,
    world: int,
    gpu: bool,
    budget: float,
    budgets: dict[str, int],
) -> dict[str, int]:
    """Each role's token budget against this rank's memory (the `debug memory` model, `fit_passes`):
    `auto` becomes at most the full-length rows its heaviest pass fits in `HEADROOM` of the memory left
    beside the model states and the rollout engine (never below one row); a budget the user set, or
    row micro-batches (0), that the model says will not fit is a warning naming what would. A row that
    does not fit even alone is refused here, before any engine, naming the pass and what would fit."""
    fits = fit_passes(
        cfg, shape, dict(ds), world, precision.rollout, budget, budget / 2**30 if gpu else None, role_shapes(cfg)
    )
    t, errors, out, said = longest_row(cfg), [], dict(budgets), []
    for role, fit in fits.items():
        rc = getattr(cfg.roles, role)
        if fit.rows() < 1:
            errors.append(ConfigError(f"roles.{role}", _no_row_fits(cfg, role, fit)))
            continue
        rows = max(1, fit.rows(HEADROOM))
        if cfg.trainer.sequence_parallel_size > 1:
            continue  # one row a micro-batch (`token_budget`)
        if rc.max_tokens_per_micro_batch == "auto":
            out[role] = min(budgets[role], rows * t)
            why = "memory" if out[role] < budgets[role] else "micro_batch_size"
            said.append(f"{role} {out[role]:,} ({out[role] // t} x {t:,}-token rows; {why})")
        elif 0 < budgets[role] < t:
            log.warning(
                "roles.%s.max_tokens_per_micro_batch %d is below one row of up to %d tokens: a micro-batch holds "
                "one row at least, so up to %d tokens run in one",
                *(role, budgets[role], t, t),
            )
        elif (budgets[role] or rc.micro_batch_size * t) > rows * t:
            asked = budgets[role] or rc.micro_batch_size * t
            log.warning(
                "roles.%s: micro-batches of %d tokens may not fit this rank's %.1f GiB: the memory model fits %d "
                "row(s) of %d tokens (%.2f GiB a row beside %.1f GiB of model states and buffers); "
                "max_tokens_per_micro_batch: auto picks that",
                *(role, asked, budget / 2**30, rows, t, fit.row_bytes / 2**30, fit.resident_bytes / 2**30),
            )
    raise_all(errors)
    if said:
        log.info("token budget per micro-batch: %s", ", ".join(said))
    return out


def _no_row_fits(cfg: RunConfig, role: str, fit) -> str:
    """The one line for a row too long for this rank: the pass, the GiB, and what would fit."""
    left = fit.budget_bytes - fit.resident_bytes
    per_token = fit.row_bytes / fit.row_tokens
    shorter = int(max(left, 0) / per_token) if per_token else 0  # rows are near-linear in memory
    ways = [f"rows of up to ~{shorter:,} tokens (data.max_prompt_length + rollout.max_new_tokens)"]
    if not cfg.precision.enable_grad_checkpointing and fit.stage == "update":
        ways.append("precision.enable_grad_checkpointing: true")
    if fit.stage == "update" and getattr(cfg.roles, role).offload == "none":
        ways.append(f"roles.{role}.offload (the optimizer states to the host)")
    return (
        f"one {fit.row_tokens:,}-token row's {fit.stage} pass needs ~{fit.row_bytes / 2**30:,.2f} GiB beside "
        f"~{fit.resident_bytes / 2**30:,.2f} GiB of model states and buffers, over this rank's "
        f"{fit.budget_bytes / 2**30:,.1f} GiB: " + ", or ".join(ways)
    )


def zero_stages(
    cfg: RunConfig, shape: ModelShape, files: dict, precision: ResolvedPrecision, world: int, budget: float
) -> dict[str, int]:
    """What `roles.<role>.zero_stage: auto` means here: the lowest stage whose analytic estimate (the
    `debug memory` model) fits this rank's `budget` (GPU memory, or RAM / ranks on this node)."""
    auto = [r for r in files if getattr(cfg.roles, r).zero_stage == "auto"]
    if not auto:
        return {}
    ds = render_ds_configs(cfg, world, precision, files=files)
    chosen = choose_zero_stages(cfg, shape, ds, world, budget, auto, role_shapes=role_shapes(cfg))
    log.info("zero_stage auto -> %s (budget %.1f GiB per rank)", chosen, budget / 2**30)
    return chosen
