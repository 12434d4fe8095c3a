"""What this rank's memory allows a run, decided once at start before any engine (`fit_memory`): the
bytes a rank may use, a rollout batch that could never fit refused, `zero_stage: auto` chosen, every
role's DeepSpeed config rendered for it, token budgets fitted by the memory model (`estimate`), and
that model's estimate of the run's stages."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

from verl_ds.config import Batches, RunConfig
from verl_ds.diagnostics.memory import (  # the package's face (this module is not part of it: setup's)
    BYTES,
    ModelShape,
    choose_zero_stages,
    estimate_memory,
    fit_passes,
    role_shapes,
    rollout_memory,
    stage_totals,
    workload,
)
from verl_ds.ds_config import render_roles
from verl_ds.errors import ConfigError, raise_all
from verl_ds.precision import TRAINED_ROLES, ResolvedPrecision

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemoryFit:
    """What `fit_memory` decided for one rank."""

    budget: float  # bytes this rank may use (`rank_budget`)
    ds: Mapping[str, dict]  # each active role's DeepSpeed config, with `zero_stage: auto` chosen
    token_budgets: Mapping[str, int]  # each role's tokens per micro-batch, fitted to the budget
    estimate: Mapping[str, float]  # the memory model's bytes per stage, one rank


def fit_memory(
    cfg: RunConfig,
    shape: ModelShape,
    files: dict,
    precision: ResolvedPrecision,
    world: int,
    gpu: bool,
    batch: Batches,
    share_prefixes: bool = False,
) -> MemoryFit:
    """The run against this rank's memory, each decision after the ones it needs (`batch`: the config's
    batch arithmetic, `config.batches`; `share_prefixes`: `RunSetup.share_prefixes`)."""
    _say_no_ops(cfg, files, gpu)
    budget = rank_budget(cfg, world, gpu)
    check_batch_fits(cfg, shape, precision, world, gpu, budget)
    stages = zero_stages(cfg, shape, files, precision, world, budget, batch)
    ds = render_roles(cfg, batch, precision, stages, files)
    token_budgets = fit_token_budgets(cfg, shape, ds, precision, world, gpu, budget, batch, share_prefixes)
    gpu_gib = budget / 2**30 if gpu else None
    estimate = stage_totals(estimate_memory(cfg, shape, dict(ds), world, precision.rollout, gpu_gib, role_shapes(cfg)))
    return MemoryFit(budget, MappingProxyType(ds), MappingProxyType(token_budgets), MappingProxyType(estimate))


def _say_no_ops(cfg: RunConfig, files: dict, gpu: bool) -> None:
    """The trained roles' memory settings that do nothing on CPU, said once."""
    if gpu:
        return
    trained = [r for r in files if r in TRAINED_ROLES]
    sleepers = ",".join(r for r in trained if getattr(cfg.roles, r).sleep)
    if sleepers:
        log.info("roles.{%s}.sleep: a no-op on CPU (no device memory to hand to the rollout)", sleepers)
    offloaders = ",".join(r for r in trained if getattr(cfg.roles, r).offload_activations)
    if offloaders:
        log.info("roles.{%s}.offload_activations: a no-op on CPU (activations are in host memory)", offloaders)


def rank_budget(cfg: RunConfig, world: int, gpu: bool) -> float:
    """The bytes one rank may use: `trainer.rank_memory_gb`, or its GPU (less vLLM's share when vLLM
    keeps it while the roles train; apart, `trainer.rollout_ranks`, a trainer rank's GPU holds no engine),
    or this node's RAM (its cgroup's limit, where lower) over the ranks on it (apart, the rollout ranks
    too: one node)."""
    if cfg.trainer.rank_memory_gb != "auto":
        return float(cfg.trainer.rank_memory_gb) * 2**30
    apart = cfg.trainer.rollout_ranks
    if gpu:
        import torch

        budget = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        if not apart and not cfg.rollout.sleep and cfg.rollout.engine == "vllm":
            budget *= 1 - cfg.rollout.gpu_memory_utilization  # vLLM keeps its share while training
        return budget
    import psutil

    ranks = int(os.environ.get("LOCAL_SIZE", world)) + apart  # a split launch's LOCAL_SIZE counts one kind
    return min(psutil.virtual_memory().total, _cgroup_limit()) / ranks


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
    batch: Batches,
    share_prefixes: bool = False,
) -> dict[str, int]:
    """Each role's token budget against this rank's memory (the `debug memory` model, `fit_passes`):
    `auto` becomes at most the full-length rows its heaviest pass fits in `HEADROOM` of the memory left
    beside the model states and the rollout engine (never below one row); a budget the user set, or
    row micro-batches (0), that the model says will not fit is a warning naming what would. A row that
    does not fit even alone is refused here, before any engine, naming the pass and what would fit. Under
    sequence parallelism a micro-batch is one row, or with `share_prefixes` one pack of rows split over the
    group: up to one prompt's group (its prompt once, `rollout.n` full-length responses), as many tokens as
    the memory fits."""
    fits = fit_passes(
        cfg, shape, dict(ds), world, precision.rollout, budget, budget / 2**30 if gpu else None, role_shapes(cfg)
    )
    budgets, t = batch.token_budgets, batch.longest_row
    errors, out, said = [], dict(budgets), []
    for role, fit in fits.items():
        rc = getattr(cfg.roles, role)
        if fit.rows() < 1:
            errors.append(ConfigError(f"roles.{role}", _no_row_fits(cfg, role, fit)))
            continue
        rows = max(1, fit.rows(HEADROOM))
        if cfg.trainer.sequence_parallel_size > 1:
            if share_prefixes:  # the rows of a pack (`roles/prefix.py`) run as one sequence, split: a prompt's
                # group at most (its prompt once, its n responses), as the attention over a pack is quadratic
                group = t + (cfg.rollout.n - 1) * max(t - cfg.data.max_prompt_length, 1)
                out[role] = max(t, min(group, fit.tokens(HEADROOM)))
                said.append(f"{role} {out[role]:,} (a pack of rows sharing prefixes, split over the SP group)")
            continue  # else one row a micro-batch (`token_budget`)
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
    cfg: RunConfig,
    shape: ModelShape,
    files: dict,
    precision: ResolvedPrecision,
    world: int,
    budget: float,
    batch: Batches,
) -> dict[str, int]:
    """What `roles.<role>.zero_stage: auto` means here: the lowest stage whose analytic estimate (the
    `debug memory` model) fits this rank's `budget` (GPU memory, or RAM / ranks on this node)."""
    auto = [r for r in files if getattr(cfg.roles, r).zero_stage == "auto"]
    if not auto:
        return {}
    ds = render_roles(cfg, batch, precision, None, files)
    chosen = choose_zero_stages(cfg, shape, ds, world, budget, auto, role_shapes=role_shapes(cfg))
    log.info("zero_stage auto -> %s (budget %.1f GiB per rank)", chosen, budget / 2**30)
    return chosen
