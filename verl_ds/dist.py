"""The bottom layer: process-group setup, rank/world, "is distributed?" and small collectives.

Every layer uses these; nobody re-implements them. Works in a single process (pytest, a script)
and under the deepspeed launcher / torchrun. Collectives run on the accelerator's device, as NCCL
needs (gloo takes CPU tensors).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import socket
from datetime import timedelta

import torch

from verl_ds.process import remove_deepspeed_shm_at_exit, remove_orphaned_deepspeed_shm

log = logging.getLogger(__name__)


def on_gpu() -> bool:
    """The one place the device is decided: CUDA wherever torch sees a GPU (the process group, every
    role, the rollout engine and memory accounting follow it). To run on the CPU of a GPU machine,
    hide the GPUs: `CUDA_VISIBLE_DEVICES=`."""
    return torch.cuda.is_available()


def bind_device() -> None:
    """One GPU per local rank (`LOCAL_RANK`), before anything touches CUDA: a CUDA call before it (the
    hardware's facts, NCCL) would open a context on cuda:0 in every rank. Idempotent; nothing on a CPU."""
    if on_gpu():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(timeout_s: float | None = None, rollout_ranks: int = 0) -> None:
    """Idempotent. Outside a launcher, fills the env a 1-rank world needs (else DeepSpeed tries MPI).
    `timeout_s` bounds every collective and store wait (`trainer.collective_timeout_s`; None:
    DeepSpeed's default). On CPU, local rank 0 first removes the /dev/shm buffers of jobs that are
    gone (its own job's ranks create theirs only once the group forms). `rollout_ranks` > 0: the last
    ranks of the launch split off (`split_launch`): this process's group is then its kind's."""
    import deepspeed
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if rollout_ranks and split_launch(rollout_ranks, timeout_s or 600.0) == "rollout":
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s or 600.0))
        return
    bind_device()
    if not on_gpu() and os.environ.get("LOCAL_RANK", "0") == "0":
        remove_orphaned_deepspeed_shm()
    timeout = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    # DeepSpeed prints its CPU all-reduce op's build ("... shm_comm_op built successfully") on every
    # start: library chatter, kept off the run's console
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        deepspeed.init_distributed("nccl" if on_gpu() else "gloo", **timeout)
    for line in printed.getvalue().splitlines():
        log.debug("deepspeed: %s", line)
    if not on_gpu():
        remove_deepspeed_shm_at_exit()  # DeepSpeed's CPU all-reduce buffer in /dev/shm


# --------------------------------------------------------------- rollout ranks apart
_SPLIT: dict = {}  # "kind": trainer | rollout, "bridge": the Bridge over every rank of the launch


def split_launch(rollout_ranks: int, timeout_s: float) -> str:
    """Split the launch's ranks into trainer ranks (the first ones) and `rollout_ranks` rollout ranks (the
    last): each kind gets a process group of its own, with the env its libraries read (RANK, WORLD_SIZE,
    LOCAL_SIZE; the rollout ranks' group on MASTER_PORT + 1), so every collective of a kind stays within
    it; every rank of the launch joins one `Bridge` (MASTER_PORT + 2) that carries rows and weights
    between them. -> this process's kind. One node for now (LOCAL_SIZE is split as the world is)."""
    launch_rank, launched = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    trainers = launched - rollout_ranks
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    os.environ["VERL_DS_LAUNCH_WORLD"] = str(launched)
    kind = "trainer" if launch_rank < trainers else "rollout"
    if kind == "trainer":
        os.environ.update(WORLD_SIZE=str(trainers), LOCAL_SIZE=str(trainers))
    else:
        me = launch_rank - trainers
        os.environ.update(
            RANK=str(me), LOCAL_RANK=str(me), WORLD_SIZE=str(rollout_ranks), LOCAL_SIZE=str(rollout_ranks)
        )
        os.environ["MASTER_PORT"] = str(port + 1)
    _SPLIT.update(kind=kind, bridge=Bridge(launch_rank, launched, trainers, addr, port + 2, timeout_s))
    return kind


def is_rollout_rank() -> bool:
    """This process is a rollout rank (`split_launch`)."""
    return _SPLIT.get("kind") == "rollout"


def bridge() -> Bridge | None:
    """The launch's bridge between trainer and rollout ranks (`split_launch`); None when colocated."""
    return _SPLIT.get("bridge")


class Bridge:
    """Messages between the two kinds of rank: a process group of its own over every rank of the
    launch (gloo, built from its own store, so neither kind's group knows of it). A message is plain data
    (dicts, lists, numbers, strings, tensors), saved with `torch.save` and loaded `weights_only`, sent as
    its length, then its bytes; `isend` returns at once (the
    weights go while the trainer ranks carry on), `wait` before the next."""

    def __init__(self, launch_rank: int, launched: int, trainers: int, addr: str, port: int, timeout_s: float):
        import torch.distributed as dist

        timeout = timedelta(seconds=timeout_s)
        self.rank, self.size, self.trainers = launch_rank, launched, trainers
        self.store = dist.TCPStore(addr, port, launched, is_master=launch_rank == 0, timeout=timeout)
        self.group = dist.ProcessGroupGloo(
            dist.PrefixStore("verl_ds/bridge", self.store), launch_rank, launched, timeout
        )
        self._pending: list = []
        self.sent_bytes = 0

    def rollout_rank_of(self, trainer: int) -> int:
        """The launch rank of the rollout rank that serves trainer rank `trainer`."""
        return self.trainers + trainer % (self.size - self.trainers)

    def trainers_of(self, rollout: int) -> list[int]:
        """The trainer ranks rollout rank `rollout` (its launch rank) serves."""
        return [t for t in range(self.trainers) if self.rollout_rank_of(t) == rollout]

    def isend(self, obj, dst: int) -> int:
        """Send `obj` to launch rank `dst` without waiting; -> its bytes."""
        buf = io.BytesIO()
        torch.save(obj, buf)
        payload = torch.frombuffer(bytearray(buf.getbuffer()), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        self._pending += [(self.group.send([size], dst, 0), size), (self.group.send([payload], dst, 1), payload)]
        self.sent_bytes += payload.numel()
        return payload.numel()

    def send(self, obj, dst: int) -> int:
        n = self.isend(obj, dst)
        self.wait()
        return n

    def wait(self) -> None:
        """Every send made so far has been received."""
        pending, self._pending = self._pending, []
        for work, _buffer in pending:
            work.wait()

    def recv(self, src: int):
        """The next object from launch rank `src` (tensors on the CPU)."""
        size = torch.zeros(1, dtype=torch.int64)
        self.group.recv([size], src, 0).wait()
        payload = torch.empty(int(size), dtype=torch.uint8)
        self.group.recv([payload], src, 1).wait()
        return torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=True)


def peer_lost(exc: BaseException) -> bool:
    """True when `exc` (or what it was raised from or during) is a collective or store failure: a peer's
    connection closed or reset (gloo), a collective timed out, the store unreachable. A bug raised
    on this rank is not: its traceback is the message."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, torch.distributed.DistError) or (isinstance(exc, RuntimeError) and "/gloo/" in str(exc)):
            return True
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)  # as a traceback shows
    return False


def lost_ranks(wait_s: float = 5.0) -> list[int]:
    """After a collective failed (`peer_lost`): the ranks that are gone, by a roll call on the
    launcher's store (MASTER_ADDR:MASTER_PORT, hosted by rank 0). Every surviving rank that caught
    such a failure checks in and waits `wait_s` for the others; a rank still missing then is gone
    (or hung: no answer either way). An unreachable store means rank 0, its host, is gone."""
    me, world = rank(), world_size()
    try:
        store = torch.distributed.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            world,
            is_master=False,
            timeout=timedelta(seconds=wait_s),
        )
        store.set(f"verl_ds/roll_call/{me}", "1")
        keys = [f"verl_ds/roll_call/{r}" for r in range(world)]
        try:
            store.wait(keys, timedelta(seconds=wait_s))
        except torch.distributed.DistStoreError:  # wait's timeout: someone did not check in
            pass
        return [r for r, key in enumerate(keys) if not store.check([key])]
    except (torch.distributed.DistError, RuntimeError):  # the store's host is gone
        return [0]


def failure_text(exc: BaseException) -> str:
    """A failed collective's first sentence without gloo's source path."""
    return str(exc).split("] ", 1)[-1].split(". ")[0].splitlines()[0]


def lost_peer_line(exc: BaseException) -> str | None:
    """One line for a rank whose collective failed because peers went away (`peer_lost`): the ranks
    gone (`lost_ranks`) and the failure's first sentence without gloo's source path; None for any
    other error."""
    if not peer_lost(exc):
        return None
    gone = lost_ranks()
    what = failure_text(exc)
    if not gone:  # every rank answered the roll call: a timeout between live ranks
        who = "no rank is"
    else:
        who = f"rank {gone[0]} is" if len(gone) == 1 else f"ranks {', '.join(map(str, gone))} are"
    return f"{who} gone: a collective failed on rank {rank()} ({type(exc).__name__}: {what})"


def is_distributed() -> bool:
    """True when a process group with more than one rank is up."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def barrier() -> None:
    if is_distributed():
        import torch.distributed as dist

        dist.barrier()


def device_tensor(values, dtype=torch.float64) -> torch.Tensor:
    """A tensor on this rank's accelerator, as NCCL all-reduces need (gloo takes CPU)."""
    from deepspeed.accelerator import get_accelerator

    return torch.tensor(values, dtype=dtype, device=get_accelerator().current_device_name())


_SHM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def sum_(t: torch.Tensor) -> None:
    """In-place SUM over ranks. On one CPU node: DeepSpeed's shared-memory all-reduce (2 ranks: 4 us
    for a few floats, 0.4 ms for 1.3 MB, vs 630 us and 3.1 ms through gloo's loopback TCP). Its
    kernel silently skips other dtypes, non-contiguous tensors and ranks on several nodes, so those,
    and GPUs, take the process group's all-reduce."""
    import deepspeed.comm as dsc
    import torch.distributed as dist

    if (
        t.device.type == "cpu"
        and t.dtype in _SHM_DTYPES
        and t.is_contiguous()
        and dsc.is_initialized()
        and os.environ.get("LOCAL_SIZE") == str(dist.get_world_size())
    ):
        dsc.inference_all_reduce(t)  # itself falls back to the process group where the CPU lacks its ISA
    else:
        dist.all_reduce(t)


def all_reduce_sum(values: list[float]) -> list[float]:
    """Sum a few floats over ranks in float32 (exact for counts below 2**24; identity in a 1-rank world)."""
    if not is_distributed():
        return list(values)
    t = device_tensor(values, torch.float32)
    sum_(t)
    return t.cpu().tolist()


def all_reduce_min(value: float) -> float:
    """The smallest `value` over ranks, as float32 (counts; identity in a 1-rank world): each rank
    fills its own slot of a zero vector and the sum gathers them, so one cheap SUM serves."""
    import torch.distributed as dist

    if not is_distributed():
        return value
    t = device_tensor([0.0] * dist.get_world_size(), torch.float32)
    t[dist.get_rank()] = value
    sum_(t)
    return float(t.min())


def all_reduce_max(value: float) -> float:
    """The largest `value` over ranks (identity in a 1-rank world)."""
    return -all_reduce_min(-value)


class BucketAllReduce:
    """Averages many tensors over the ranks, in place, through one reusable flat buffer per dtype;
    tensors of a bucket's size or more are reduced where they lie. DeepSpeed's ZeRO-0 path instead
    flattens every gradient into a fresh model-sized buffer each step: on CPU that allocation's page
    faults cost more than the all-reduce itself."""

    def __init__(self, bucket_bytes: int = 32 << 20):
        self.bucket_bytes = bucket_bytes
        self._buffers: dict = {}

    def __call__(self, tensors) -> None:
        if not is_distributed():
            return
        import torch.distributed as dist

        scale = 1.0 / dist.get_world_size()  # sum, then scale: DeepSpeed's order (bitwise alike)
        pending, size = [], 0
        for t in tensors:
            nbytes = t.numel() * t.element_size()
            if nbytes >= self.bucket_bytes:
                sum_(t)
                t.mul_(scale)
                continue
            if pending and (pending[0].dtype != t.dtype or size + nbytes > self.bucket_bytes):
                self._flush(pending, scale)
                pending, size = [], 0
            pending.append(t)
            size += nbytes
        if pending:
            self._flush(pending, scale)

    def _flush(self, tensors: list, scale: float) -> None:
        key = (tensors[0].dtype, tensors[0].device)
        if key not in self._buffers:
            self._buffers[key] = torch.empty(
                self.bucket_bytes // tensors[0].element_size(), dtype=key[0], device=key[1]
            )
        flat = self._buffers[key][: sum(t.numel() for t in tensors)]
        views = flat.split([t.numel() for t in tensors])
        for v, t in zip(views, tensors):
            v.copy_(t.reshape(-1))
        sum_(flat)
        flat.mul_(scale)
        for v, t in zip(views, tensors):
            t.copy_(v.view_as(t))


def all_gather_object(obj) -> list:
    """Every rank's `obj`, in rank order (`[obj]` in a 1-rank world). Off the hot path only."""
    import torch.distributed as dist

    if not is_distributed():
        return [obj]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


_TP_GROUPS: dict[int, tuple] = {}


def tp_group(size: int):
    """(process group, member ranks) of this rank's group of `size` consecutive ranks. Collective
    on first use for a size (every rank creates every group), cached after."""
    if size not in _TP_GROUPS:
        import torch.distributed as dist

        mine, _ = dist.new_subgroups(group_size=size)
        first = rank() // size * size
        _TP_GROUPS[size] = (mine, list(range(first, first + size)))
    return _TP_GROUPS[size]
