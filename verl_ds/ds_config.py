"""Each role's final DeepSpeed config: its JSON file from ds_configs/ + the precision blocks of the
resolved precision (fp16/bf16, loss scaling, grad-accum and communication dtypes) + the batch
sizes, optimizer settings and gradient clipping the run config implies.

`render_ds_configs(cfg, world, resolved)` is what `verl-ds config render` prints and what every role
is built from. The checks of the YAML and of the JSON files it names live in `config.validate`; the
one left here needs the merged precision (bf16 with fp32 gradient accumulation at ZeRO stage 0).
"""

from __future__ import annotations

import copy

from verl_ds.config import Batches, batches, default_world, read_ds_files
from verl_ds.errors import ConfigError
from verl_ds.precision import (
    TRAINED_ROLES,
    Hardware,
    LossScaling,
    ResolvedPrecision,
    resolve_for_files,
)


def precision_blocks(dtype: str, scaling: LossScaling | None) -> dict:
    """The fp16/bf16 blocks DeepSpeed reads for a compute dtype (fp32 and int8: neither)."""
    if dtype == "fp16":
        s = scaling or LossScaling()
        return {
            "fp16": {
                "enabled": True,
                "auto_cast": False,
                "loss_scale": s.loss_scale,
                "initial_scale_power": s.initial_scale_power,
                "loss_scale_window": s.loss_scale_window,
                "hysteresis": s.hysteresis,
                "consecutive_hysteresis": s.consecutive_hysteresis,
                "min_loss_scale": s.min_loss_scale,
            }
        }
    if dtype == "bf16":
        return {"bf16": {"enabled": True}}
    return {}


def offload_blocks(offload: str) -> dict:
    """The `zero_optimization` blocks of `roles.<role>.offload`: to the CPU, pinned."""
    parts = offload.split("+")
    keys = [k for part, k in (("optimizer", "offload_optimizer"), ("params", "offload_param")) if part in parts]
    return {k: {"device": "cpu", "pin_memory": True} for k in keys}


def render_role(
    role: str,
    base: dict,
    source: str,
    precision: ResolvedPrecision,
    *,
    micro_batch_size: int,
    train_batch_size: int,
    world_size: int,
    max_grad_norm: float,
    optimizer_params: dict | None,
    json_loss_scaling: bool = True,
    offload: str = "none",
    sleep: bool = False,
    sequence_parallel: bool = False,
) -> dict:
    """(Long on purpose: one block per DeepSpeed key it sets, each the one place that key is decided.)
    Merge one role's DeepSpeed JSON with its resolved precision and batch settings.

    Trained roles get an optimizer; frozen ones lose any optimizer block. `json_loss_scaling`: an
    fp16 block in the JSON keeps its loss-scaling keys (the role's dtype was `auto`, deferring to
    the file); an explicit dtype takes the PrecisionConfig's loss scaling. `offload`
    (`roles.<role>.offload`): DeepSpeed's offload_optimizer / offload_param blocks, to the CPU, pinned.
    `sleep` (`roles.<role>.sleep`): refused where DeepSpeed builds an optimizer that cannot move its states.
    `sequence_parallel`: the run splits rows (`trainer.sequence_parallel_size` > 1).
    """
    ds = copy.deepcopy(base)
    dtype = precision.role(role)
    json_fp16 = ds.pop("fp16", {})
    ds.pop("bf16", None)
    # int8 is weight-only quantization applied by the reward role; DeepSpeed itself runs fp32.
    ds.update(precision_blocks(dtype, getattr(precision, f"{role}_loss_scaling", None)))
    if dtype == "fp16" and json_fp16.get("enabled") and json_loss_scaling:
        ds["fp16"].update(json_fp16)  # the JSON's own loss-scaling keys
    stage = int(ds.get("zero_optimization", {}).get("stage", 0))
    if offload != "none":
        ds.setdefault("zero_optimization", {}).update(offload_blocks(offload))

    trained = role in TRAINED_ROLES
    if trained:
        if precision.grad_accum:
            if dtype == "bf16" and precision.grad_accum == "fp32" and stage == 0:
                raise ConfigError(
                    "precision.grad_accum",
                    f"bf16 with fp32 grad accumulation at ZeRO stage 0 is rejected by DeepSpeed ({source}); "
                    "use stage >= 1",
                )
            if sleep and dtype == "bf16" and precision.grad_accum == "fp32" and stage == 1:
                raise ConfigError(
                    f"roles.{role}.sleep",
                    "bf16 with fp32 grad accumulation at ZeRO stage 1 runs DeepSpeed's BF16_Optimizer, "
                    "which cannot move its states to the host; use stage 2 or 3",
                )
            ds.setdefault("data_types", {})["grad_accum_dtype"] = precision.grad_accum
        comm = getattr(precision, f"{role}_comm")
        if comm:
            ds["communication_data_type"] = comm
        if sequence_parallel:
            # under SP DeepSpeed reduces gradients in `seq_parallel_communication_data_type` (fp32 unless
            # set) instead: the role's own communication dtype holds there too, as PrecisionConfig says
            # (fp32 would also hold an fp32 copy of each 16-bit gradient bucket)
            ds["seq_parallel_communication_data_type"] = comm or dtype
        if ds.get("gradient_clipping", "auto") == "auto":
            ds["gradient_clipping"] = float(max_grad_norm)
        opt = ds.setdefault("optimizer", {"type": "AdamW", "params": {"torch_adam": True}})
        params = opt.setdefault("params", {})
        for k, v in (optimizer_params or {}).items():
            if params.get(k, "auto") == "auto":
                params[k] = v
        if "optimizer" in offload.split("+"):
            # ZeRO-Offload steps the fp32 masters on the host with DeepSpeedCPUAdam (its C++ op is
            # built once into the per-user extension cache); a torch optimizer is refused there
            params.pop("torch_adam", None)
            params.pop("fused", None)
        elif params.get("torch_adam") and "foreach" not in params and "fused" not in params:
            # torch's fused AdamW: one kernel over every tensor instead of a Python loop per tensor
            # (CPU and CUDA have it; the same math; measured in docs/BENCHMARKS.md)
            params["fused"] = True
    else:
        ds.pop("optimizer", None)
        ds.pop("scheduler", None)
        ds.pop("gradient_clipping", None)
        train_batch_size = micro_batch_size * world_size

    _fill_batch_sizes(ds, micro_batch_size, train_batch_size, world_size)
    ds.setdefault("steps_per_print", 10**9)
    ds.setdefault("wall_clock_breakdown", False)
    return ds


def _fill_batch_sizes(ds: dict, micro: int, total: int, world: int) -> None:
    """Fill DeepSpeed's "auto" batch keys (config.validate checked that they are consistent)."""
    if ds.get("train_micro_batch_size_per_gpu", "auto") == "auto":
        ds["train_micro_batch_size_per_gpu"] = micro
    ds["train_batch_size"] = total
    if ds.get("gradient_accumulation_steps", "auto") == "auto":
        ds["gradient_accumulation_steps"] = total // (ds["train_micro_batch_size_per_gpu"] * world)


def run_precision(cfg, hw: Hardware | None = None, files: dict[str, dict] | None = None) -> ResolvedPrecision:
    """A config's precision alone (`config render`, `debug memory`, the benchmarks), resolved as a run's
    setup resolves it (`precision.resolve_for_files`), the roles' JSON files read here unless given."""
    return resolve_for_files(cfg.precision, cfg.trainer.device, files or read_ds_files(cfg), hw)


def render_ds_configs(
    cfg,
    world_size: int | None = None,
    precision: ResolvedPrecision | None = None,
    zero_stages: dict[str, int] | None = None,
    files: dict[str, dict] | None = None,
) -> dict[str, dict]:
    """`render_roles` for a config alone: on `world_size` ranks (default: `config.default_world`), the
    precision and the JSON files resolved and read here unless given (`config render`, `debug memory`)."""
    files = files or read_ds_files(cfg)
    precision = precision or run_precision(cfg, files=files)
    return render_roles(cfg, batches(cfg, world_size or default_world(cfg)), precision, zero_stages, files)


def render_roles(
    cfg, batch: Batches, precision: ResolvedPrecision, zero_stages: dict[str, int] | None, files: dict[str, dict]
) -> dict[str, dict]:
    """Every active role's final DeepSpeed config, as DeepSpeed will receive it, from its JSON file
    (`files`: as `config.read_ds_files` read them; left as they are), for the config's batch arithmetic
    (`batch`, `config.batches`: DeepSpeed's is over data-parallel ranks). A role's ZeRO stage is
    `roles.<role>.zero_stage` when it is a number, else `zero_stages[role]` (what `auto` chose,
    see trainer/setup.py), else its JSON file's."""
    b = batch
    out = {}
    for role, ds in files.items():
        rc = getattr(cfg.roles, role)
        stage = rc.zero_stage if isinstance(rc.zero_stage, int) else (zero_stages or {}).get(role)
        if stage is not None:  # a new dict: `files` stays as read
            ds = {**ds, "zero_optimization": {**ds.get("zero_optimization", {}), "stage": stage}}
        out[role] = render_role(
            role,
            ds,
            rc.ds_config,
            precision,
            micro_batch_size=b.micro[role],
            train_batch_size=b.mini,
            world_size=b.dp_world,
            max_grad_norm=cfg.trainer.max_grad_norm,
            optimizer_params={"lr": rc.lr, "weight_decay": rc.weight_decay, "betas": list(rc.betas)},
            json_loss_scaling=cfg.precision.role_dtype(role) == "auto",
            offload=rc.offload,
            sleep=rc.sleep,
            sequence_parallel=cfg.trainer.sequence_parallel_size > 1,
        )
    return out
