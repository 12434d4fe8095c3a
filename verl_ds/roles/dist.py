"""Process-group setup shared by every role (single process under pytest, or the deepspeed launcher)."""
from __future__ import annotations

import atexit
import glob
import logging
import os
import socket

import torch

log = logging.getLogger(__name__)
_FP16_SHIM_DONE = False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed() -> None:
    """Idempotent. Outside a launcher, fills the env a 1-rank world needs (else DeepSpeed tries MPI)."""
    import deepspeed
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    deepspeed.init_distributed("nccl" if torch.cuda.is_available() else "gloo")
    if not torch.cuda.is_available():
        atexit.register(_remove_shm_buffer)


def _remove_shm_buffer() -> None:
    """DeepSpeed's CPU shm all-reduce leaves a ~66 MB /dev/shm file per rank and run; remove ours."""
    name = f"deepspeed_allreduce_buffer_*_{os.environ.get('MASTER_ADDR')}_{os.environ.get('MASTER_PORT')}_" \
           f"{os.environ.get('RANK', '0')}"
    for f in glob.glob(os.path.join("/dev/shm", name)):
        try:
            os.remove(f)
        except OSError:
            pass


def rank() -> int:
    import torch.distributed as dist
    return dist.get_rank() if dist.is_initialized() else 0


def barrier() -> None:
    import torch.distributed as dist
    if dist.is_initialized():
        dist.barrier()


def device_tensor(values, dtype=torch.float64) -> torch.Tensor:
    """A tensor on this rank's accelerator, as NCCL all-reduces need (gloo takes CPU)."""
    from deepspeed.accelerator import get_accelerator
    return torch.tensor(values, dtype=dtype, device=get_accelerator().current_device_name())


def all_reduce_sum(values: list[float]) -> list[float]:
    """Sum a few floats over ranks (identity in a 1-rank world)."""
    import torch.distributed as dist
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return list(values)
    t = device_tensor(values)
    dist.all_reduce(t)
    return t.cpu().tolist()


def world_size() -> int:
    import torch.distributed as dist
    return dist.get_world_size() if dist.is_initialized() else 1


def enable_cpu_fp16() -> None:
    """DeepSpeed's CPU accelerator refuses fp16 (is_fp16_supported() is None), although its fp16
    optimizers and dynamic loss scaling work there. Applied only when a role asks for fp16 on CPU;
    logged once. GPUs never need it."""
    global _FP16_SHIM_DONE
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    if _FP16_SHIM_DONE or acc.device_name() != "cpu" or acc.is_fp16_supported():
        return
    acc.is_fp16_supported = lambda: True
    acc.supported_dtypes = lambda: [torch.float, torch.bfloat16, torch.float16]
    _FP16_SHIM_DONE = True
    log.warning("fp16 on CPU: enabled DeepSpeed's fp16 path on the CPU accelerator (emulated, slow; "
                "for correctness checks)")
