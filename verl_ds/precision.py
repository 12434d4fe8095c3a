"""PrecisionConfig (what the user asks for) and its resolution, once, into concrete dtypes.

`resolve_precision(precision, hardware, json_dtypes)` is the only place `auto` meets the hardware:
it returns an immutable `ResolvedPrecision` (every role, the rollout, the buffer, comm dtypes) that
the trainer builds once and passes down. `verl_ds/ds_config.py` renders it into DeepSpeed JSON.
See docs/ARCHITECTURE.md ("Precision").
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Optional

import torch

from verl_ds.errors import ConfigError

log = logging.getLogger(__name__)

# The one dtype vocabulary: what a user may write, the floating compute dtypes (what a role, a
# rollout, a benchmark or the advisor can run), their torch dtypes and back.
DTYPES = ("fp32", "fp16", "bf16", "int8", "auto")
COMPUTE_DTYPES = ("fp32", "bf16", "fp16")
TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def dtype_name(dtype: torch.dtype) -> str:
    """The project's name of a torch dtype (fp32, bf16, fp16, int8), else torch's own name."""
    if dtype in (torch.int8, torch.qint8):
        return "int8"
    return next((k for k, v in TORCH_DTYPES.items() if v == dtype), str(dtype).removeprefix("torch."))
TRAINED_ROLES = ("actor", "critic")
ROLES = ("actor", "critic", "reference", "reward")


@dataclass
class LossScaling:
    """DeepSpeed's fp16 dynamic loss scaling for one role (used only when the role is fp16)."""

    loss_scale: float = 0.0  # 0 = dynamic
    initial_scale_power: int = 11  # 2**11 = 2048
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
    reward_dtype: str = "auto"  # may be int8 (weight-only quantization)
    reward_activation_dtype: str = "auto"
    rollout_dtype: str = "auto"
    buffer_dtype: str = "bf16"  # what the rollout buffer stores logprobs/values in
    grad_accum_dtype: Optional[str] = None  # None: DeepSpeed's default
    actor_comm_dtype: Optional[str] = None  # gradient all-reduce dtype; None: fp32 for fp16 roles
    critic_comm_dtype: Optional[str] = None
    enable_grad_checkpointing: bool = False
    lm_head_fp32: bool = False  # logits + log-softmax in fp32 (actor, reference, rollout)
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
            raise ConfigError(
                f"{prefix}actor_master_weight_dtype",
                "DeepSpeed keeps fp32 master weights for fp16/bf16 roles; only fp32 is supported",
            )
        for role in TRAINED_ROLES:
            ls = getattr(self, f"{role}_loss_scaling")
            if isinstance(ls, dict):  # Python API convenience: plain dicts are accepted
                setattr(self, f"{role}_loss_scaling", LossScaling(**ls))

    def role_dtype(self, role: str) -> str:
        return getattr(self, f"{role}_dtype")


# ---------------------------------------------------------------- hardware facts and the auto rule


@dataclass(frozen=True)
class Hardware:
    """The facts the `auto` rule reads. Tests inject them; `detect_hardware` reads this machine."""

    device: str = "cpu"  # cpu | cuda
    cuda_capability: tuple = (0, 0)
    cpu_flags: frozenset = frozenset()

    @property
    def cpu_bf16(self) -> bool:
        """The CPU computes bf16 natively (avx512_bf16 or AMX); without, ATen emulates it (~40x slower)."""
        return bool({"avx512_bf16", "amx_bf16"} & set(self.cpu_flags))


def detect_hardware(device: str = "auto") -> Hardware:
    """This machine's facts; `device` is `trainer.device` (auto | cpu | cuda)."""
    if device in ("auto", "cuda") and torch.cuda.is_available():
        return Hardware("cuda", tuple(torch.cuda.get_device_capability()))
    return Hardware("cpu", cpu_flags=frozenset(_cpu_flags()))


def auto_compute_dtype(hw: Hardware) -> tuple[str, str]:
    """The `auto` rule: (dtype, reason). bf16 on CUDA >= 8.0 and on CPUs with bf16 hardware; fp16
    (dynamic loss scaling) on older CUDA; fp32 on CPUs where bf16 is emulated (~40x slower)."""
    if hw.device == "cuda":
        major, minor = hw.cuda_capability
        if major >= 8:
            return "bf16", f"CUDA capability {major}.{minor} >= 8"
        return "fp16", f"CUDA capability {major}.{minor} < 8: fp16 with dynamic loss scaling"
    if hw.cpu_bf16:
        return "bf16", "CPU has avx512_bf16/AMX"
    return "fp32", "CPU without avx512_bf16/AMX: bf16 matmul is ~40x slower here"


def _cpu_flags() -> set:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@dataclass(frozen=True)
class ResolvedPrecision:
    """Concrete dtypes for one run (no `auto` left). `reward` may be int8 (weight-only)."""

    actor: str
    critic: str
    reference: str
    reward: str
    reward_activation: str
    rollout: str
    buffer: str
    grad_accum: Optional[str]
    actor_comm: Optional[str]
    critic_comm: Optional[str]
    actor_loss_scaling: LossScaling
    critic_loss_scaling: LossScaling
    auto_choice: str  # what `auto` meant on this hardware, and why
    auto_reason: str
    lm_head_fp32: bool = False

    def role(self, name: str) -> str:
        return getattr(self, name)

    def torch_dtype(self, name: str) -> torch.dtype:
        return TORCH_DTYPES[self.role(name)]


def resolve_precision(
    p: PrecisionConfig, hw: Hardware, json_dtypes: dict[str, str] | None = None, log_choice: bool = True
) -> ResolvedPrecision:
    """`auto` -> a concrete dtype. An explicit dtype wins; for a role, `auto` first defers to a
    fp16/bf16 block in its DeepSpeed JSON (`json_dtypes[role]`), then to the hardware rule. An
    `auto` rollout follows the actor (same numbers on both sides of the sync)."""
    auto, why = auto_compute_dtype(hw)
    json_dtypes = json_dtypes or {}

    def pick(value: str, role: str | None = None) -> str:
        if value != "auto":
            return value
        from_json = json_dtypes.get(role or "", "fp32")
        return from_json if from_json != "fp32" else auto

    roles = {r: pick(p.role_dtype(r), r) for r in ROLES}
    rollout = pick(p.rollout_dtype) if p.rollout_dtype != "auto" else roles["actor"]
    comm = {r: getattr(p, f"{r}_comm_dtype") or ("fp32" if roles[r] == "fp16" else None) for r in TRAINED_ROLES}
    if log_choice and "auto" in (
        p.actor_dtype,
        p.critic_dtype,
        p.reference_dtype,
        p.reward_dtype,
        p.rollout_dtype,
        p.buffer_dtype,
        p.reward_activation_dtype,
    ):
        log.info("precision 'auto' -> %s (%s)", auto, why)
    return ResolvedPrecision(
        **roles,
        reward_activation=pick(p.reward_activation_dtype),
        rollout=rollout,
        buffer=pick(p.buffer_dtype),
        grad_accum=p.grad_accum_dtype,
        actor_comm=comm["actor"],
        critic_comm=comm["critic"],
        actor_loss_scaling=p.actor_loss_scaling,
        critic_loss_scaling=p.critic_loss_scaling,
        auto_choice=auto,
        auto_reason=why,
        lm_head_fp32=p.lm_head_fp32,
    )
