"""PrecisionConfig: the one place a user states each role's precision, rendered into DeepSpeed JSON.

Each role's final DeepSpeed config = its JSON file from ds_configs/ + the precision blocks from
here (fp16/bf16, loss scaling, grad-accum and communication dtypes) + the batch sizes and
gradient clipping the run config implies. `verl-ds config render` prints exactly that result.
"""
from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass, field, fields
from functools import lru_cache
from pathlib import Path
from typing import Optional

import torch

from verl_ds.errors import ConfigError

log = logging.getLogger(__name__)

DTYPES = ("fp32", "fp16", "bf16", "int8", "auto")
TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
TRAINED_ROLES = ("actor", "critic")
ROLES = ("actor", "critic", "reference", "reward")
DS_CONFIG_DIR = Path(__file__).resolve().parent.parent / "ds_configs"


@dataclass
class LossScaling:
    """DeepSpeed's fp16 dynamic loss scaling for one role (used only when the role is fp16)."""
    loss_scale: float = 0.0            # 0 = dynamic
    initial_scale_power: int = 11      # 2**11 = 2048
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0


@dataclass
class PrecisionConfig:
    actor_dtype: str = "auto"
    actor_master_weight_dtype: str = "fp32"
    critic_dtype: str = "auto"
    reference_dtype: str = "auto"
    reward_dtype: str = "auto"            # may be int8 (weight-only quantization)
    reward_activation_dtype: str = "auto"
    rollout_dtype: str = "auto"
    buffer_dtype: str = "bf16"            # what the rollout buffer stores logprobs/values in
    grad_accum_dtype: Optional[str] = None  # None: DeepSpeed's default
    actor_comm_dtype: Optional[str] = None  # gradient all-reduce dtype; None: fp32 for fp16 roles
    critic_comm_dtype: Optional[str] = None
    enable_grad_checkpointing: bool = False
    actor_loss_scaling: LossScaling = field(default_factory=LossScaling)
    critic_loss_scaling: LossScaling = field(default_factory=LossScaling)

    def __post_init__(self):
        self.validate()

    def validate(self, prefix: str = "precision.") -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not f.name.endswith(("_dtype",)) or value is None:
                continue
            if value not in DTYPES:
                raise ConfigError(f"{prefix}{f.name}", f"unknown dtype '{value}' (use one of {', '.join(DTYPES)})")
            if value == "int8" and f.name != "reward_dtype":
                why = "a trained role" if f.name.split("_")[0] in TRAINED_ROLES else "this field"
                raise ConfigError(f"{prefix}{f.name}", f"int8 is only supported for the reward model, not {why}")
        if self.actor_master_weight_dtype not in ("fp32", "auto"):
            raise ConfigError(f"{prefix}actor_master_weight_dtype",
                              "DeepSpeed keeps fp32 master weights for fp16/bf16 roles; only fp32 is supported")
        for role in TRAINED_ROLES:
            ls = getattr(self, f"{role}_loss_scaling")
            if isinstance(ls, dict):  # Python API convenience: plain dicts are accepted
                setattr(self, f"{role}_loss_scaling", LossScaling(**ls))

    def role_dtype(self, role: str) -> str:
        return getattr(self, f"{role}_dtype")


@lru_cache(maxsize=None)
def auto_dtype(device: str | None = None) -> str:
    """Pick the compute dtype from the hardware and log the choice and the reason once."""
    if (device in (None, "auto", "cuda")) and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        choice, why = ("bf16", f"CUDA capability {major}.{minor} >= 8") if major >= 8 else \
            ("fp16", f"CUDA capability {major}.{minor} < 8: fp16 with dynamic loss scaling")
    else:
        flags = _cpu_flags()
        if {"avx512_bf16", "amx_bf16"} & flags:
            choice, why = "bf16", "CPU has avx512_bf16/AMX"
        else:
            choice, why = "fp32", "CPU without avx512_bf16/AMX: bf16 matmul is ~40x slower here"
    log.info("precision 'auto' -> %s (%s)", choice, why)
    return choice


def _cpu_flags() -> set:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


# ---------------------------------------------------------------- rendering

def resolve_ds_path(name: str) -> Path:
    p = Path(name)
    if p.is_absolute() or p.exists():
        return p
    return DS_CONFIG_DIR / name


def read_ds_json(name: str, key: str) -> dict:
    path = resolve_ds_path(name)
    if not name:
        raise ConfigError(key, "no DeepSpeed JSON file given")
    if not path.is_file():
        raise ConfigError(key, f"DeepSpeed config file not found: {path}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(str(path), f"malformed JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    if not isinstance(data, dict):
        raise ConfigError(str(path), "a DeepSpeed config must be a JSON object")
    return data


def precision_blocks(dtype: str, scaling: LossScaling | None) -> dict:
    """The fp16/bf16 blocks DeepSpeed reads for a compute dtype (fp32 and int8: neither)."""
    if dtype == "fp16":
        s = scaling or LossScaling()
        return {"fp16": {"enabled": True, "auto_cast": False, "loss_scale": s.loss_scale,
                         "initial_scale_power": s.initial_scale_power,
                         "loss_scale_window": s.loss_scale_window, "hysteresis": s.hysteresis,
                         "consecutive_hysteresis": s.consecutive_hysteresis,
                         "min_loss_scale": s.min_loss_scale}}
    if dtype == "bf16":
        return {"bf16": {"enabled": True}}
    return {}


def render_role(role: str, base: dict, source: str, precision: PrecisionConfig, *,
                device: str | None, micro_batch_size: int, train_batch_size: int, world_size: int,
                max_grad_norm: float, optimizer_params: dict | None) -> dict:
    """Merge one role's DeepSpeed JSON with its precision and batch settings.

    `auto` dtypes are resolved here (see above). Trained roles get an optimizer; frozen ones
    lose any optimizer block. Raises ConfigError naming the file or key on inconsistent input.
    """
    ds = copy.deepcopy(base)
    if ds.get("fp16", {}).get("enabled") and ds.get("bf16", {}).get("enabled"):
        raise ConfigError(source, f"fp16 and bf16 are both enabled for the {role}")
    # An explicit PrecisionConfig dtype wins; `auto` defers to a precision block in the JSON file,
    # and only then to the hardware rule.
    dtype = precision.role_dtype(role)
    from_json = ds_dtype(ds) if dtype == "auto" and ds_dtype(ds) != "fp32" else None
    dtype = from_json or (auto_dtype(device) if dtype == "auto" else dtype)
    json_fp16 = ds.pop("fp16", {})
    ds.pop("bf16", None)
    # int8 is weight-only quantization applied by the reward role; DeepSpeed itself runs fp32.
    ds.update(precision_blocks(dtype, getattr(precision, f"{role}_loss_scaling", None)))
    if from_json == "fp16":
        ds["fp16"].update(json_fp16)
    stage = int(ds.get("zero_optimization", {}).get("stage", 0))

    trained = role in TRAINED_ROLES
    if trained:
        if precision.grad_accum_dtype:
            if dtype == "bf16" and precision.grad_accum_dtype == "fp32" and stage == 0:
                raise ConfigError("precision.grad_accum_dtype",
                                  f"bf16 with fp32 grad accumulation at ZeRO stage 0 is rejected by DeepSpeed ({source}); use stage >= 1")
            ds.setdefault("data_types", {})["grad_accum_dtype"] = precision.grad_accum_dtype
        comm = getattr(precision, f"{role}_comm_dtype") or ("fp32" if dtype == "fp16" else None)
        if comm:
            ds["communication_data_type"] = comm
        if ds.get("gradient_clipping", "auto") == "auto":
            ds["gradient_clipping"] = float(max_grad_norm)
        opt = ds.setdefault("optimizer", {"type": "AdamW", "params": {"torch_adam": True}})
        params = opt.setdefault("params", {})
        for k, v in (optimizer_params or {}).items():
            if params.get(k, "auto") == "auto":
                params[k] = v
    else:
        if stage in (1, 2):
            raise ConfigError(source, f"the {role} is inference-only: DeepSpeed needs an optimizer for ZeRO "
                                      f"stage {stage}; use stage 0 or 3")
        ds.pop("optimizer", None)
        ds.pop("scheduler", None)
        ds.pop("gradient_clipping", None)
        train_batch_size = micro_batch_size * world_size

    _fill_batch_sizes(ds, f"{source} (roles.{role}.micro_batch_size)", micro_batch_size, train_batch_size,
                      world_size)
    ds.setdefault("steps_per_print", 10**9)
    ds.setdefault("wall_clock_breakdown", False)
    return ds


def _fill_batch_sizes(ds: dict, source: str, micro: int, total: int, world: int) -> None:
    if ds.get("train_micro_batch_size_per_gpu", "auto") == "auto":
        ds["train_micro_batch_size_per_gpu"] = micro
    if ds.get("train_batch_size", "auto") == "auto":
        ds["train_batch_size"] = total
    if ds["train_batch_size"] != total:   # the loop's mini-batch is what one optimizer step must see
        raise ConfigError(source, f"train_batch_size {ds['train_batch_size']} != the run's mini-batch {total} "
                                  "(trainer.mini_batch_size); use \"auto\"")
    micro = ds["train_micro_batch_size_per_gpu"]
    if micro <= 0 or total % (micro * world):
        raise ConfigError(source, f"train_batch_size {total} is not divisible by micro batch {micro} x "
                                  f"{world} ranks")
    gas = total // (micro * world)
    if ds.get("gradient_accumulation_steps", "auto") == "auto":
        ds["gradient_accumulation_steps"] = gas
    elif ds["gradient_accumulation_steps"] != gas:
        raise ConfigError(source, f"gradient_accumulation_steps {ds['gradient_accumulation_steps']} != "
                                  f"train_batch_size {total} / (micro {micro} x {world} ranks)")


def ds_dtype(ds: dict) -> str:
    """The compute dtype a rendered DeepSpeed config asks for."""
    if ds.get("fp16", {}).get("enabled"):
        return "fp16"
    if ds.get("bf16", {}).get("enabled"):
        return "bf16"
    return "fp32"
