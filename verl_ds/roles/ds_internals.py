"""Every DeepSpeed (and torch tensor-subclass) internal the project reads, each behind one named function.

Written against DeepSpeed 0.19.8 (`DEEPSPEED_VERSION`; compare `deepspeed.__version__`) and torch
2.13. Nothing outside this module (and `rollout/engines/vllm_internals.py` for vLLM) touches these
attributes: `tests/test_structure.py` checks it, and `tests/roles/test_ds_internals.py` builds real
engines at ZeRO stages 0-3 and checks that each function still returns what it claims, so a DeepSpeed
upgrade that moves one fails there, by name.

DeepSpeed's public API is used where it serves: `deepspeed.zero.GatheredParameters` (the ZeRO-3
gather). Its per-parameter accessors (`deepspeed.utils.safe_get_local_grad`,
`safe_get_local_fp32_param`, `safe_get_full_grad`, ...) do not: they are ZeRO-3 only (the local
ones) or all-reduce one parameter at a time (the full ones), return copies where the step needs the
real storage (`Role.force_skip` writes into it), and would put a Python loop over every parameter
into every optimizer step. The flat partitions below are read in one piece instead.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import Callable, Iterable, Iterator

import torch

log = logging.getLogger(__name__)

DEEPSPEED_VERSION = "0.19.8"  # the version every function here was written and tested for


# ------------------------------------------------------------------ ZeRO-3 parameters
def is_zero3(module: torch.nn.Module) -> bool:
    """Whether `module`'s parameters are ZeRO-3 partitioned: DeepSpeed 0.19.8 tags each such
    parameter with `ds_id` (its own `safe_get_*` accessors test the same attribute). Works on a
    plain module (no engine at hand), where `engine.zero_optimization_stage()` would not."""
    return any(hasattr(p, "ds_id") for p in module.parameters())


def gathered(params: list, zero3: bool):
    """Context in which ZeRO-3 `params` hold their full data (`deepspeed.zero.GatheredParameters`,
    public API, read-only: `modifier_rank=None`); a no-op context otherwise. Collective under
    ZeRO-3: every rank enters it with the same parameters."""
    if not zero3:
        return nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


def iter_gathered(
    module: torch.nn.Module,
    whole: Callable[[torch.nn.Module], bool] | None = None,
    drop: Callable[[torch.nn.Module], Iterable[torch.nn.Parameter]] | None = None,
    zero3: bool | None = None,
) -> Iterator[tuple[str, torch.nn.Module, list[tuple[str, torch.nn.Parameter]]]]:
    """The one ZeRO-3 gather walk (full-weight export, weight sync, LoRA merge): `(mod_name, mod,
    own)` for every module in `named_modules` order, `own` the `(name, param)` pairs it holds that no
    earlier module yielded (a tied parameter once, under its first name). Under ZeRO-3 only `own` is
    gathered, and only while the caller holds the yield (so the whole model is never held twice:
    copy what must outlive it). `whole(mod)`: take all of `mod`'s parameters, its children's
    included, in one gather (a peft LoRA layer, merged from its base and adapter weights);
    `drop(mod)`: parameters never streamed (marked visited, not gathered), `mod` itself skipped;
    `zero3`: `is_zero3(module)` where the caller knows it already."""
    zero3 = is_zero3(module) if zero3 is None else zero3
    seen: set[int] = set()
    for mod_name, mod in module.named_modules():
        dropped = list(drop(mod)) if drop is not None else []
        if dropped:
            seen.update(id(p) for p in dropped)
            continue
        if whole is not None and whole(mod):
            own = list(mod.named_parameters())
        else:
            own = [(n, p) for n, p in mod.named_parameters(recurse=False) if id(p) not in seen]
        if not own:
            continue
        seen.update(id(p) for _, p in own)
        with gathered([p for _, p in own], zero3):
            yield mod_name, mod, own


def local_tensor(p: torch.nn.Parameter) -> torch.Tensor:
    """The tensor this rank stores for `p`: its ZeRO-3 partition (`p.ds_tensor`, DeepSpeed 0.19.8;
    `p.data` is an empty placeholder outside a gather), else `p.data`."""
    t = getattr(p, "ds_tensor", None)
    return t if t is not None else p.data


def full_numel(p: torch.nn.Parameter) -> int:
    """`p`'s element count before partitioning: `p.ds_numel` under ZeRO-3 (DeepSpeed 0.19.8; `p.numel()`
    is 0 there outside a gather), else `p.numel()`."""
    return getattr(p, "ds_numel", p.numel())


# ------------------------------------------------------------------ optimizer state
def grad_partitions(engine) -> list[torch.Tensor]:
    """This rank's reduced gradients as the optimizer will step them (after the boundary backward),
    in a few large tensors, the storage itself (writes reach the step). DeepSpeed 0.19.8:
    ZeRO-3 `optimizer.grad_partitions_flat_buffer` (one flat buffer, this rank's share);
    ZeRO-1/2 `optimizer.averaged_gradients` ({group: [partition, ...]}); stage 0 (plain torch or
    FP16_UnfusedOptimizer) every `p.grad`. Fast path: no per-parameter public accessor (see the
    module docstring)."""
    opt = engine.optimizer
    if hasattr(opt, "grad_partitions_flat_buffer"):  # ZeRO-3
        return [opt.grad_partitions_flat_buffer]
    if hasattr(opt, "averaged_gradients"):  # ZeRO-1/2
        return [g for gs in opt.averaged_gradients.values() if gs for g in gs if g is not None]
    return [p.grad for p in engine.module.parameters() if p.grad is not None]  # stage 0


def torch_optimizer(opt):
    """The torch optimizer inside DeepSpeed's wrapper (ZeRO / fp16 optimizers keep it as
    `.optimizer`, DeepSpeed 0.19.8); a plain torch optimizer is itself."""
    return getattr(opt, "optimizer", opt)


def master_params(engine) -> list[torch.Tensor]:
    """The tensors the optimizer updates (fp32 masters for 16-bit roles), this rank's share, at any
    stage. DeepSpeed 0.19.8: ZeRO-1/2 `single_partition_of_fp32_groups`, ZeRO-3
    `fp32_partitioned_groups_flat`, bf16 optimizer `fp32_groups_flat_partition` (flat partitions);
    else the wrapped torch optimizer's `param_groups` (public). Fast path: the public
    `safe_get_local_fp32_param` is ZeRO-3 only and per parameter."""
    opt = engine.optimizer
    for attr in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat_partition"):
        if getattr(opt, attr, None):
            return list(getattr(opt, attr))
    return [p for g in torch_optimizer(opt).param_groups for p in g["params"]]


def loss_scale(opt) -> float:
    """The current (dynamic) loss scale: `cur_scale` (ZeRO optimizers) or `loss_scale` (stage-0
    FP16_UnfusedOptimizer), DeepSpeed 0.19.8; 1.0 when neither is set. The public
    `engine.loss_scale()` is the configured static scale (0: dynamic), not the current one."""
    return float(getattr(opt, "cur_scale", getattr(opt, "loss_scale", 1.0)) or 1.0)


def overflowed(opt) -> bool:
    """Whether the optimizer's last step found inf/NaN gradients (`optimizer.overflow`, DeepSpeed
    0.19.8; False for a plain torch optimizer)."""
    return bool(getattr(opt, "overflow", False))


# ------------------------------------------------------------------ sleep: states to host memory and back
def offload_states(engine) -> Callable[[], None]:
    """Move every state of a trained ZeRO (1-3) engine to host memory (pinned on CUDA) and return the
    function that brings them back, bitwise. DeepSpeed 0.19.8's `engine.offload_states` moves them all
    at ZeRO-1/2 with any torch optimizer. At ZeRO-3 it asserts its own FusedAdam for two of them
    (`optim_states`, `hp_params`: stage3.py `offload_states`) although the move does not depend on
    it; verl-ds steps torch's AdamW, so DeepSpeed moves the other three and those two are moved here
    the way stage 3 moves them (`.data` swapped: the optimizer's references stay valid). Checked at
    ZeRO-1/2/3 and every dtype by tests/roles/test_sleep.py."""
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum as S

    opt = engine.optimizer
    if not hasattr(opt, "offload_states"):
        raise TypeError(f"{type(opt).__name__} has no offload_states: sleep needs a ZeRO optimizer (stage >= 1)")
    if engine.zero_optimization_stage() != 3:
        engine.offload_states(pin_memory=True)
        return engine.reload_states
    # stage 3 may make a master a view of the weights' buffer (same dtype and device); 0.19.8 compares
    # a torch.device with a string there, so it never does: a master moved apart from the weights
    # would no longer be the weights it steps
    lp = opt.lp_param_buffer.untyped_storage().data_ptr()
    if any(m.untyped_storage().data_ptr() == lp for m in opt.fp32_partitioned_groups_flat):
        raise NotImplementedError("ZeRO-3 masters that share the weights' buffer: sleep cannot move them apart")
    engine.offload_states(include=[S.lp_params, S.lp_grads, S.contiguous_grad_buffer], pin_memory=True)
    own = list(opt.fp32_partitioned_groups_flat)
    own += [v for s in torch_optimizer(opt).state.values() for v in s.values() if torch.is_tensor(v)]
    devices = [t.device for t in own]
    for t in own:
        host = torch.empty_like(t, device="cpu", pin_memory=t.is_cuda)
        t.data = host.copy_(t)

    def reload() -> None:
        engine.reload_states()
        for t, d in zip(own, devices):
            # a fresh tensor on CPU too, where `.to(d)` would keep the host copy
            t.data = torch.empty_like(t, device=d).copy_(t)

    return reload


# ------------------------------------------------------------------ engine switches
def set_backward_allreduce(engine, enabled: bool) -> None:
    """Switch DeepSpeed's gradient all-reduce in `engine.backward` (`engine.enable_backward_allreduce`,
    DeepSpeed 0.19.8). Off for fp32 ZeRO-0 on CPU, where `dist.BucketAllReduce` reduces instead. The
    public `engine.no_sync()` would need a context around every backward; this is one flag at build."""
    engine.enable_backward_allreduce = enabled


def backward_allreduce(engine) -> bool:
    """Whether `engine.backward` all-reduces the gradients (see `set_backward_allreduce`)."""
    return bool(engine.enable_backward_allreduce)


def enable_cpu_fp16() -> None:
    """DeepSpeed's CPU accelerator refuses fp16 (0.19.8: `is_fp16_supported()` is None), although its
    fp16 optimizers and dynamic loss scaling work there: its `is_fp16_supported`/`supported_dtypes`
    are replaced on the accelerator object. Applied only when a role asks for fp16 on CPU; logged
    once. GPUs never need it."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    if acc.device_name() != "cpu" or acc.is_fp16_supported():
        return
    acc.is_fp16_supported = lambda: True
    acc.supported_dtypes = lambda: [torch.float, torch.bfloat16, torch.float16]
    log.warning(
        "fp16 on CPU: enabled DeepSpeed's fp16 path on the CPU accelerator (emulated, slow; for correctness checks)"
    )


# ------------------------------------------------------------------ process groups
def quiet_bf16_optimizer() -> None:
    """DeepSpeed's `BF16_Optimizer` prints its memory (`see_memory_usage(..., force=True)`: "begin
    bf16_optimizer", "MA ... GB", "CPU Virtual Memory: ...") at every bf16 start, into every one-line
    error's output too: those lines go to the debug log, as the rest of DeepSpeed's chatter does.
    Idempotent."""
    import contextlib
    import io

    from deepspeed.runtime import bf16_optimizer

    printing = bf16_optimizer.see_memory_usage
    if getattr(printing, "quiet", False):
        return

    def to_debug_log(message, force=False):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            printing(message, force=force)
        for line in out.getvalue().splitlines():
            log.debug("deepspeed: %s", line)

    to_debug_log.quiet = True
    bf16_optimizer.see_memory_usage = to_debug_log


def gradient_divisor(engine) -> float:
    """What DeepSpeed divides the sum of the ranks' gradients by, its "average": the world; under
    sequence parallelism the world / SP at ZeRO-0/1/2 and at ZeRO-3 without reduce-scatter
    (`engine._reduce_non_expert_gradients`, `stage_1_and_2.average_tensor`,
    `stage3.__avg_scatter_contiguous_grads` divide by that), while ZeRO-3's reduce-scatter
    (`reduce_scatter_coalesced`) divides by the world. A loss scaled by it gets the summed gradient
    back at every stage (a fixed world would be SP times too large at ZeRO-1/2)."""
    sp = getattr(engine, "sequence_parallel_size", 1)
    if sp > 1 and not (engine.zero_optimization_stage() == 3 and engine.zero_reduce_scatter()):
        return engine.world_size / sp
    return float(engine.world_size)


def forget_destroyed_world() -> None:
    """Drop DeepSpeed's references to process groups of a world that is gone. DeepSpeed keeps groups
    cloned from the world (`deepspeed.utils.groups`: the world clone, the data-parallel group, ...)
    and releases them only in its own `deepspeed.comm.destroy_process_group`; vLLM's engine shutdown
    destroys torch's default group directly. An engine built afterwards in the same process (the next
    `bench precision` cell) would broadcast over a dead group. A no-op while the world is up."""
    import torch.distributed as dist
    from deepspeed.utils import groups

    if dist.is_available() and dist.is_initialized():
        return
    groups._release_process_group_references(group=None)


# ------------------------------------------------------------------ quantized weights
def storage_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold `t`'s data: a wrapper tensor subclass gives its inner tensors,
    recursively (torchao 0.18's `Int8Tensor`: the int8 `qdata`, its `scale` and `zero_point`), through
    torch 2.13's protocol for them (`is_traceable_wrapper_subclass`, `__tensor_flatten__`); a plain
    tensor is itself. Its own `numel() * element_size()` counts a quantized weight at its logical dtype."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not is_traceable_wrapper_subclass(t):
        return [t]
    names, _ = t.__tensor_flatten__()
    return [inner for name in names for inner in storage_tensors(getattr(t, name))]


def torch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """torch's own linear op (`torch._C._nn.linear`, what `torch.nn.functional.linear` is in torch
    2.13). DeepSpeed 0.19.8's ZeRO-3 (`memory_efficient_linear`, on by default) rebinds
    `torch.nn.functional.linear` process-wide once any ZeRO-3 engine is built, to a wrapper that
    computes `input.matmul(weight.t())`: every `nn.Linear` of the process then goes through it."""
    return torch._C._nn.linear(x, weight, bias)
