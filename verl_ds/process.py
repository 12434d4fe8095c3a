"""Process-wide settings, made in one explicit, logged place.

`setup_process` is the one call that changes the process for the in-process vLLM engine (thread
binding, torch.compile off, stale /dev/shm segments, the GC heap frozen); `VLLMRollout` makes it
right before the engine starts. `remove_deepspeed_shm_at_exit` is registered once by
`dist.init_distributed` (DeepSpeed's CPU all-reduce buffer), which also calls
`remove_orphaned_deepspeed_shm` once per node before the process group forms. The bottom layer: imports nothing of
verl_ds; the caller hands in the rank.
"""

from __future__ import annotations

import atexit
import gc
import glob
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger(__name__)


def cpu_share() -> str:
    """This rank's share of the cores (by LOCAL_RANK), as vLLM's VLLM_CPU_OMP_THREADS_BIND list: two
    in-process engines would otherwise both pin core 0, and the engine's binding also applies to the
    trainer in the same process."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    local, size = (
        int(os.environ.get("LOCAL_RANK", 0)),
        int(os.environ.get("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", 1))),
    )
    per = max(1, len(cores) // max(size, 1))
    mine = cores[local * per : (local + 1) * per] or cores[-1:]
    return ",".join(map(str, mine))


def remove_stale_vllm_tp_shm(rank: int, tp: int) -> list[Path]:
    """vLLM's CPU tensor-parallel group creates /dev/shm/<...>-[<ranks>]-cpushm_<i> with O_EXCL and a
    name that does not change between runs; a killed run's file would make the next start fail
    (errno 17). Each rank removes its own stale one before the engine starts; returns what went."""
    ranks = "-".join(str(x) for x in range(rank // tp * tp, rank // tp * tp + tp))
    removed = []
    for f in Path("/dev/shm").glob(f"*-[[]{ranks}[]]-cpushm_{rank % tp}"):
        log.info("removing a stale vLLM CPU shm segment %s", f)
        f.unlink(missing_ok=True)
        removed.append(f)
    return removed


def disable_torch_compile() -> None:
    """Every `torch.compile` in the process runs eagerly: torch 2.13's global switch
    `torch._dynamo.config.disable` (consulted at each compiled call, so setting it after the
    compiled functions were defined still works). Private torch config, read nowhere else."""
    import torch._dynamo

    torch._dynamo.config.disable = True


def allocator() -> str:
    """The malloc this process runs on: a preloaded tcmalloc, jemalloc or mimalloc (its library mapped
    into the process), else glibc's."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    return next((name for name in ("tcmalloc", "jemalloc", "mimalloc") if f"lib{name}" in maps), "glibc")


def release_free_memory() -> str | None:
    """Hand the allocator's free pages back to the kernel (tcmalloc's `ReleaseFreeMemory`, glibc's
    `malloc_trim`), so a step's transient memory (activations, logits, generation buffers) does not stay
    resident as the process's floor until the next step. Returns the allocator that released, None
    where this one cannot."""
    import ctypes

    name = allocator()
    try:
        if name == "tcmalloc":  # preloaded: its symbols are in the process's global namespace
            ctypes.CDLL(None).MallocExtension_ReleaseFreeMemory()
        elif name == "glibc":
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        else:
            return None
    except (OSError, AttributeError):
        return None
    return name


def setup_process(*, rank: int, cpu: bool, eager: bool, tensor_parallel: int, freeze_gc: bool = True) -> dict:
    """The process-wide settings an in-process vLLM engine needs, made just before it starts; one log
    line says what was set. Returns {setting: value}.

    - CPU: `VLLM_CPU_OMP_THREADS_BIND` = this rank's `cpu_share` (unless the user set it);
    - CPU + eager: torch.compile off (`disable_torch_compile`): eager on CPU, yet vLLM's sampler
      still torch.compiles one logprob-rank helper at the first generation, 1.3 s per rank of
      tracing and codegen for a one-line op (3.5 s of the quickstart's first step); nothing else in
      the process is compiled on CPU;
    - CPU compiled: `VLLM_USE_AOT_COMPILE=0` (unless the user set it): a later start finds the
      compiled model in inductor's cache;
    - CPU + tensor parallel: this rank's stale vLLM shm segment removed (`remove_stale_vllm_tp_shm`);
    - `freeze_gc`: `gc.freeze()`: vLLM collects then freezes the whole GC heap once it is up
      (freeze_gc_heap); freezing it first makes that collect scan only the engine's own objects
      (1.2 s less per rank on CPU). Call it after vLLM is imported, right before the engine.
    """
    done: dict = {}
    if cpu:
        done["VLLM_CPU_OMP_THREADS_BIND"] = os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_share())
        if eager:
            disable_torch_compile()
            done["torch_compile"] = "off"
        else:  # vllm-cpu 0.32 saves its AOT-compiled model but cannot load it back (a missing
            # `finalize_loading`), so every start compiled anew; inductor's own cache does load
            done["VLLM_USE_AOT_COMPILE"] = os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
        if tensor_parallel > 1:
            done["stale_tp_shm_removed"] = len(remove_stale_vllm_tp_shm(rank, tensor_parallel))
    if freeze_gc:
        gc.freeze()
        done["gc"] = "frozen"
    log.info("process settings for the vLLM engine: %s", ", ".join(f"{k}={v}" for k, v in done.items()))
    return done


DS_SHM_BUFFERS = "/dev/shm/deepspeed_allreduce_buffer_*"


def remove_orphaned_deepspeed_shm() -> list[str]:
    """Remove DeepSpeed's CPU all-reduce buffers (`DS_SHM_BUFFERS`) that no live process holds. A
    rank killed with SIGKILL cannot remove its own (`remove_deepspeed_shm_buffer` runs at exit), and
    the name carries the run's port, so no later run reuses (or removes) it: each such file keeps its
    RAM until removed. A buffer's rank keeps the file open and mapped from creation to exit
    (DeepSpeed's shm.cpp never closes the descriptor), so "nobody has it open or mapped" is exactly
    "its job is gone"; a job running beside this one keeps its files. Returns the removed paths."""
    paths = set(glob.glob(DS_SHM_BUFFERS))  # listed before the scan: a file created later is not judged
    orphans = sorted(paths - held_by_live_processes(paths)) if paths else []
    for f in orphans:
        try:
            os.remove(f)
        except OSError:  # another user's file (sticky /dev/shm), or another start removed it first
            pass
    if orphans:
        log.info("removed %d DeepSpeed shm buffer(s) of jobs that are gone: %s", len(orphans), " ".join(orphans))
    return orphans


def held_by_live_processes(paths: set[str]) -> set[str]:
    """The `paths` some live process has open (/proc/<pid>/fd) or mapped (/proc/<pid>/maps). A
    process this user cannot inspect is another user's, and cannot open our files (mode 0600)."""
    held: set[str] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for fd in (proc / "fd").iterdir():
                try:
                    target = os.readlink(fd)
                except OSError:
                    continue
                if target in paths:
                    held.add(target)
            with open(proc / "maps") as maps:
                for line in maps:
                    if "/dev/shm/" in line:
                        path = line.split(maxsplit=5)[-1].rstrip("\n")
                        if path in paths:
                            held.add(path)
        except OSError:  # the process ended meanwhile, or it is not ours to read
            continue
    return held


def remove_deepspeed_shm_buffer() -> None:
    """DeepSpeed's CPU shm all-reduce leaves a ~66 MB /dev/shm file per rank and run; remove ours
    (named by MASTER_ADDR, MASTER_PORT and RANK)."""
    name = (
        f"deepspeed_allreduce_buffer_*_{os.environ.get('MASTER_ADDR')}_{os.environ.get('MASTER_PORT')}_"
        f"{os.environ.get('RANK', '0')}"
    )
    for f in glob.glob(os.path.join("/dev/shm", name)):
        try:
            os.remove(f)
        except OSError:
            pass


def remove_deepspeed_shm_at_exit() -> None:
    """Register `remove_deepspeed_shm_buffer` to run when the process exits (CPU process groups)."""
    atexit.register(remove_deepspeed_shm_buffer)


def log_to_console() -> None:
    """verl-ds's own lines on stdout, prefixed; other libraries' INFO chatter (compiler probes, font
    caches) stays off the console: the root logger is at WARNING, only verl_ds's at INFO."""
    logging.basicConfig(level=logging.WARNING, format="[verl-ds] %(message)s", stream=sys.stdout)
    logging.getLogger("verl_ds").setLevel(logging.INFO)
    # torchao (int8 roles; transformers imports it whenever installed) warns on every import that its
    # CUDA kernels do not load on a CPU machine and that it uses a deprecated torch pytree call: not
    # actionable by users
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
