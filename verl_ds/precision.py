"""PrecisionConfig (what the user asks for) and its resolution, once, into concrete dtypes.

`resolve_precision(precision, hardware, json_dtypes)` is the only place `auto` meets the hardware:
it returns an immutable `ResolvedPrecision` (every role, the rollout, the buffer, comm dtypes) that
the trainer builds once and passes down. `verl_ds/ds_config.py` renders it into DeepSpeed JSON.
See docs/ARCHITECTURE.md ("Precision").
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Optional

import torch

from verl_ds import algos
from verl_ds.dist import on_gpu
from verl_ds.errors import ConfigError, RunFailure, broken
from verl_ds.schema import opt, section

log = logging.getLogger(__name__)

# The one dtype vocabulary: what a user may write, the floating compute dtypes (what a role, a
# rollout, a benchmark or the advisor can run), their torch dtypes and back.
DTYPES = ("fp32", "fp16", "bf16", "int8", "auto")
COMPUTE_DTYPES = ("fp32", "bf16", "fp16")
TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
CPU_GEMM_MODES = ("auto", "fp32", "native")  # precision.cpu_gemm (verl_ds/gemm.py)


def dtype_name(dtype: torch.dtype) -> str:
    """The project's name of a torch dtype (fp32, bf16, fp16, int8), else torch's own name."""
    if dtype == torch.int8:
        return "int8"
    return next((k for k, v in TORCH_DTYPES.items() if v == dtype), str(dtype).removeprefix("torch."))


# The role kinds, named once: which roles exist, which train, which output token logprobs.
ROLES = ("actor", "critic", "reference", "reward", "teacher")
TRAINED_ROLES = ("actor", "critic")
POLICY_ROLES = ("actor", "reference", "teacher")
INT8_ROLES = ("reward", "teacher")  # frozen roles that may hold int8 (weight-only) Linear weights


@dataclass
class LossScaling:
    """DeepSpeed's fp16 dynamic loss scaling for one role (used only when the role is fp16)."""

    # The bounds: the scale multiplies the loss in fp32, whose largest power of two is 2**127 (tiny
    # gradients can need powers far above fp16's 2**16: `debug precision` recommends them).
    loss_scale: float = opt(0.0, "a fixed loss scale; 0: dynamic", ge=0, le=2.0**127)
    initial_scale_power: int = opt(11, "the dynamic scale starts at 2**initial_scale_power", ge=0, le=127)
    loss_scale_window: int = opt(1000, "steps without overflow before the scale doubles", gt=0)
    hysteresis: int = opt(2, "overflows tolerated before the scale halves", gt=0)
    consecutive_hysteresis: bool = opt(False, "hysteresis counts consecutive overflows only")
    min_loss_scale: float = opt(1.0, "the scale never drops below this", gt=0)


_ROLE_DTYPE = "fp32 | bf16 | fp16 | auto (the hardware rule, or the role's JSON)"


@dataclass
class PrecisionConfig:
    """The one place a run states its precision: each role's compute dtype, the rollout's and the
    buffer's, gradient accumulation and communication dtypes, fp16 loss scaling per trained role."""

    actor_dtype: str = opt("auto", f"the actor's compute dtype: {_ROLE_DTYPE}; masters stay fp32", choices=DTYPES)
    actor_master_weight_dtype: str = opt(
        "fp32", "DeepSpeed keeps fp32 masters for 16-bit roles", choices=("fp32", "auto")
    )
    critic_dtype: str = opt("auto", f"the critic's compute dtype: {_ROLE_DTYPE}", choices=DTYPES)
    reference_dtype: str = opt("auto", f"the reference's dtype: {_ROLE_DTYPE}", choices=DTYPES)
    reward_dtype: str = opt("auto", f"the reward model's dtype: {_ROLE_DTYPE}, or int8 (weight-only)", choices=DTYPES)
    reward_activation_dtype: str = opt("auto", "an int8 reward model's activations", choices=DTYPES)
    teacher_dtype: str = opt(
        "auto", f"the distillation teacher's dtype: {_ROLE_DTYPE}, or int8 (weight-only)", choices=DTYPES
    )
    teacher_activation_dtype: str = opt("auto", "an int8 teacher's activations", choices=DTYPES)
    rollout_dtype: str = opt("auto", "the rollout engine's weights; auto: the actor's", choices=DTYPES)
    buffer_dtype: str = opt("bf16", "what the rollout buffer stores logprobs and values in", choices=DTYPES)
    grad_accum_dtype: Optional[str] = opt(
        None, "gradient accumulation dtype; null: DeepSpeed's", choices=(None, *DTYPES)
    )
    actor_comm_dtype: Optional[str] = opt(
        None, "the actor's gradient all-reduce dtype; null: DeepSpeed's (fp32 for fp16 roles)", choices=(None, *DTYPES)
    )
    critic_comm_dtype: Optional[str] = opt(None, "the critic's gradient all-reduce dtype", choices=(None, *DTYPES))
    enable_grad_checkpointing: bool = opt(False, "recompute activations in backward (less memory, more time)")
    lm_head_fp32: bool = opt(False, "logits and log-softmax in fp32 (actor, reference, rollout)")
    batch_invariant: bool = opt(
        False,
        "GPU: vLLM's batch-invariant kernels (VLLM_BATCH_INVARIANT: matmuls, softmax, log-softmax and means "
        "whose result for a row does not depend on what it is batched with) in every rank's process, so the "
        "rollout engine and the trainer's roles run them alike; slower; written, not yet run on a GPU by this "
        "project. CPU: a no-op (the CPU kernels' compositions: tests/roles/test_composition.py)",
    )
    cpu_gemm: str = opt(
        "auto",
        "bf16/fp16 matrix products on a CPU without kernels for them (verl_ds/gemm.py): fp32 (16-bit "
        "operands multiplied and summed in fp32, the result rounded to 16 bits, as 16-bit hardware does; "
        "fp32 speed), native (ATen's generic 16-bit loop, an order of magnitude slower), auto: fp32 for "
        "the dtypes this CPU lacks kernels for. The trainer's roles and an HF rollout (vLLM has its own CPU kernels)",
        choices=CPU_GEMM_MODES,
    )
    actor_loss_scaling: LossScaling = section(LossScaling)
    critic_loss_scaling: LossScaling = section(LossScaling)

    def __post_init__(self):
        self.validate()

    def validate(self, prefix: str = "precision.") -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not f.name.endswith(("_dtype",)) or value is None:
                continue
            if value not in DTYPES:
                raise ConfigError(f"{prefix}{f.name}", f"unknown dtype '{value}' (use one of {', '.join(DTYPES)})")
            if value == "int8" and f.name.removesuffix("_dtype") not in INT8_ROLES:
                why = "a trained role" if f.name.split("_")[0] in TRAINED_ROLES else "this field"
                raise ConfigError(
                    f"{prefix}{f.name}", f"int8 is only supported for the reward model and the teacher, not {why}"
                )
        if self.actor_master_weight_dtype not in ("fp32", "auto"):
            raise ConfigError(
                f"{prefix}actor_master_weight_dtype",
                "DeepSpeed keeps fp32 master weights for fp16/bf16 roles; only fp32 is supported",
            )
        for role in TRAINED_ROLES:
            ls = getattr(self, f"{role}_loss_scaling")
            if isinstance(ls, dict):  # Python API convenience: plain dicts are accepted
                setattr(self, f"{role}_loss_scaling", LossScaling(**ls))

    def check(self) -> list[ConfigError]:
        """The rules within this section that its fields' bounds cannot state."""
        return broken(
            *(
                (
                    ls.loss_scale == 0 and ls.min_loss_scale > 2.0**ls.initial_scale_power,
                    f"precision.{role}_loss_scaling.min_loss_scale",
                    f"{ls.min_loss_scale} is above the starting scale 2**{ls.initial_scale_power}",
                )
                for role in TRAINED_ROLES
                for ls in [getattr(self, f"{role}_loss_scaling")]
            )
        )

    def role_dtype(self, role: str) -> str:
        return getattr(self, f"{role}_dtype")


# ---------------------------------------------------------------- hardware facts and the auto rule


@dataclass(frozen=True)
class Hardware:
    """The facts the `auto` rule reads. Tests inject them; `detect_hardware` reads this machine."""

    device: str = "cpu"  # cpu | cuda
    cuda_capability: tuple = (0, 0)
    cpu_flags: frozenset = frozenset()

    def emulates(self, dtype: str) -> bool:
        """Whether `dtype` has no kernels here (ATen's generic loop, or `verl_ds/gemm.py`'s fp32
        products at fp32 speed; the numbers hold either way): fp16 on any CPU, bf16 on a CPU without
        avx512_bf16/AMX. Nothing on CUDA."""
        if self.device == "cuda" or dtype == "fp32":
            return False
        return dtype == "fp16" or not self.cpu_bf16

    @property
    def cpu_bf16(self) -> bool:
        """The CPU computes bf16 natively (avx512_bf16 or AMX); without, ATen emulates it (much slower)."""
        return bool(_BF16_FLAGS & set(self.cpu_flags))


def detect_hardware(device: str = "auto") -> Hardware:
    """This machine's facts; `device` is `trainer.device` (auto | cpu | cuda)."""
    if device in ("auto", "cuda") and on_gpu():
        return Hardware("cuda", tuple(torch.cuda.get_device_capability()))
    flags = frozenset(_cpu_flags())
    return Hardware("cpu", cpu_flags=flags - _BF16_FLAGS if _aten_below_avx512() else flags)


_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def _aten_below_avx512() -> bool:
    """ATen runs AVX2-or-lower kernels although the CPU may have more (`ATEN_CPU_CAPABILITY=avx2`,
    as `launch/numerics_avx2.sh` sets): bf16 is then emulated, so the CPU's bf16 flags must not
    count, and `auto` resolves as on an AVX2-only host."""
    return torch.backends.cpu.get_cpu_capability() in ("DEFAULT", "NO AVX", "AVX2")


def auto_compute_dtype(hw: Hardware) -> tuple[str, str]:
    """The `auto` rule: (dtype, reason). bf16 on CUDA >= 8.0 and on CPUs with bf16 hardware; fp16
    (dynamic loss scaling) on older CUDA; fp32 on CPUs where bf16 is emulated (no faster than fp32
    even as fp32 products, `verl_ds/gemm.py`, and only rounder)."""
    if hw.device == "cuda":
        major, minor = hw.cuda_capability
        if major >= 8:
            return "bf16", f"CUDA capability {major}.{minor} >= 8"
        return "fp16", f"CUDA capability {major}.{minor} < 8: fp16 with dynamic loss scaling"
    if hw.cpu_bf16:
        return "bf16", "CPU has avx512_bf16/AMX"
    return "fp32", "CPU without avx512_bf16/AMX: bf16 has no kernels here, so it is no faster than fp32"


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
    """Concrete dtypes for one run (no `auto` left). `reward` and `teacher` may be int8 (weight-only)."""

    actor: str
    critic: str
    reference: str
    reward: str
    teacher: str
    reward_activation: str
    teacher_activation: str
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
    fp32_gemm: tuple = ()  # 16-bit dtypes whose GEMMs run on fp32 copies here (verl_ds/gemm.py)
    batch_invariant: bool = (
        False  # vLLM's batch-invariant kernels in this process (`vllm_internals.batch_invariant_kernels`)
    )

    def role(self, name: str) -> str:
        return getattr(self, name)

    def torch_dtype(self, name: str) -> torch.dtype:
        return TORCH_DTYPES[self.role(name)]


# Mantissa bits of each compute dtype: the rounding between a trainer and a rollout engine that
# compute in different dtypes is what the rollout-vs-trainer logprob gap starts from.
MANTISSA_BITS = {"fp32": 23, "fp16": 10, "bf16": 7}


def mismatch_warning(actor: str, rollout: str) -> str | None:
    """One line when the actor and the rollout compute in different dtypes (None when they match):
    the trainer then scores samples under a policy that differs from the sampler's by rounding alone,
    which shows as `rollout_corr/*` gaps and PPO clipping before the policy has moved."""
    if actor == rollout:
        return None
    coarse = min((actor, rollout), key=MANTISSA_BITS.get)
    return (
        f"precision: the actor computes in {actor} and the rollout in {rollout}: their logprobs differ by "
        f"{coarse} rounding ({MANTISSA_BITS[coarse]} mantissa bits) before any update (watch rollout_corr/*; "
        f"precision.rollout_dtype: auto follows the actor)"
    )


@dataclass(frozen=True)
class MismatchGate:
    """The run's promise on the rollout-vs-trainer mismatch, in numbers (`algorithm.mismatch_gate`): the
    share of response tokens whose ratio on the same weights falls outside PPO's clip band
    (`rollout_corr/phantom_clip_fraction`, trainer/consistency.py), bounded."""

    mode: str  # off | warn | stop
    bound: float  # the share of tokens outside the clip band a step may show
    pair: str  # "bf16 actor vs bf16 rollout": named in the line

    def check(self, metrics: dict[str, float], step: int) -> str | None:
        """The step's line past the bound (logged, or raised as the run's end under `stop`); None within it."""
        share = metrics.get("rollout_corr/phantom_clip_fraction")
        if self.mode == "off" or share is None or share <= self.bound:
            return None
        line = (
            f"mismatch gate: step {step}: {share:.2%} of response tokens outside the clip band on the same weights "
            f"({self.pair}; bound {self.bound:.2%}, algorithm.mismatch_gate_fraction); |log ratio| p99 "
            f"{metrics.get('rollout_corr/log_ratio_abs_p99', float('nan')):.3g}, max "
            f"{metrics.get('rollout_corr/log_ratio_abs_max', float('nan')):.3g}, mean IS weight "
            f"{metrics.get('rollout_corr/is_weight_mean', float('nan')):.4f}"
        )
        if self.mode == "stop":
            raise RunFailure(line + " (algorithm.mismatch_gate: stop)")
        log.warning("%s", line)
        return line


def resolve_gate(
    mode: str, fraction: float, trainer_dtype: str, rollout_dtype: str, stale: bool, apart: bool
) -> MismatchGate:
    """`algorithm.mismatch_gate` (`mode`) and its bound (`mismatch_gate_fraction`, or the dtypes' default),
    said in one line; off where a step's ratios are not the pair's precision: `stale` (partial rollouts
    train tokens older weights sampled) or `apart` (rollout ranks: rows one step off-policy)."""
    pair = f"{trainer_dtype} actor vs {rollout_dtype} rollout"
    bound = fraction or algos.mismatch_gate_bound(trainer_dtype, rollout_dtype)
    if mode != "off" and stale:
        log.info("mismatch gate: off (rollout.partial: stale tokens' ratios are not the pair's precision)")
        mode = "off"
    elif mode != "off" and apart:
        log.info(
            "mismatch gate: off (trainer.rollout_ranks: rows one step off-policy, their ratios are not the pair's)"
        )
        mode = "off"
    elif mode != "off":
        log.info("mismatch gate: %s past %.2g%% of tokens outside the clip band (%s)", mode, 100 * bound, pair)
    return MismatchGate(mode, bound, pair)


def resolve_sync_check(trainer_dtype: str, rollout_dtype: str, truncates: bool, stale: bool, apart: bool) -> str:
    """How each sync is verified, said in one line: "rows" (the step's own rows, free), "probe" (a fixed
    probe the engine samples before the roles wake), or "stream" (`apart`, rollout ranks: the probe their
    rollout rank samples on the weights it took, taken once the step's scoring has run, as it arrives
    meanwhile, and checked before the update). The rows cannot tell where they hold `stale` tokens (partial
    rollouts) or where a truncated sampling set (`truncates`: top-k/top-p) on a mixed pair came from other logits."""
    if apart:
        log.info(
            "sync check: a fixed probe the rollout rank samples on each step's weights (trainer.rollout_ranks: a "
            "step's rows were sampled by the weights before), checked before the update"
        )
        return "stream"
    why = (
        "rollout.partial: a step's rows hold tokens older weights sampled"
        if stale
        else f"a truncated sampling set on {trainer_dtype} vs {rollout_dtype}: its kept set comes from other logits"
        if truncates and trainer_dtype != rollout_dtype
        else ""
    )
    if why:
        log.info("sync check: a fixed probe after each sync (%s)", why)
        return "probe"
    log.info("sync check: the actor's first scoring of each step's rows against the engine's (no extra pass)")
    return "rows"


def ds_dtype(ds: dict) -> str:
    """The compute dtype a DeepSpeed config (a role's JSON file, or as rendered) asks for."""
    if ds.get("fp16", {}).get("enabled"):
        return "fp16"
    if ds.get("bf16", {}).get("enabled"):
        return "bf16"
    return "fp32"


def json_dtypes(files: dict[str, dict]) -> dict[str, str]:
    """The compute dtype each active role's JSON file (`config.read_ds_files`) asks for (`auto` defers to it)."""
    return {role: ds_dtype(ds) for role, ds in files.items()}


def resolve_for_files(
    p: PrecisionConfig, device: str, files: dict[str, dict], hw: Hardware | None = None
) -> ResolvedPrecision:
    """`resolve_precision` on this machine (`trainer.device`; or the injected hardware) and the roles' JSON
    files as `config.read_ds_files` read them: a run's setup and a config alone resolve it here."""
    return resolve_precision(p, hw or detect_hardware(device), json_dtypes(files))


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
        p.teacher_dtype,
    ):
        log.info("precision 'auto' -> %s (%s)", auto, why)
    if log_choice and (msg := mismatch_warning(roles["actor"], rollout)):
        log.warning(msg)
    if log_choice and p.batch_invariant and hw.device != "cuda":
        log.info("precision.batch_invariant: a no-op on CPU (vLLM's batch-invariant kernels are GPU kernels)")
    activations = {
        "reward_activation": pick(p.reward_activation_dtype),
        "teacher_activation": pick(p.teacher_activation_dtype),
    }
    return ResolvedPrecision(
        **roles,
        **activations,
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
        fp32_gemm=fp32_gemm_dtypes(p.cpu_gemm, hw, {*roles.values(), *activations.values(), rollout}),
        batch_invariant=p.batch_invariant and hw.device == "cuda",
    )


def fp32_gemm_dtypes(mode: str, hw: Hardware, used) -> tuple[str, ...]:
    """The 16-bit dtypes among `used` whose GEMMs run on fp32 copies (`precision.cpu_gemm`): on a
    CPU only; `auto`: those it has no kernels for (`Hardware.emulates`)."""
    if hw.device != "cpu" or mode == "native":
        return ()
    return tuple(d for d in ("bf16", "fp16") if d in used and (mode == "fp32" or hw.emulates(d)))
