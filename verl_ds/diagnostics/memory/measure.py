"""Measured memory: every role's tensors accounted at the end of each trainer phase.

`MemoryTimer` is a `Timer`; the trainer names each phase's stage and role explicitly
(`timer("ref", stage="score", role="reference")`) and logs `memory/<stage>/<role>/<component>_mib`.
"""

from __future__ import annotations

import os
from contextlib import contextmanager, nullcontext

from verl_ds.diagnostics.memory.estimate import MIB
from verl_ds.diagnostics.metrics import Timer
from verl_ds.dist import on_gpu
from verl_ds.precision import dtype_name
from verl_ds.roles.ds_internals import local_tensor, storage_tensors, torch_optimizer


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def _dtype_name(t) -> str:
    return dtype_name(t.dtype)


def account_role(role) -> dict[str, float]:
    """Bytes a role's tensors hold now: weights by dtype (ZeRO-3: this rank's partition), fp32 master
    partitions, gradients, optimizer states. A tensor counted once (first category wins). On a GPU
    only device tensors count (an offloaded optimizer, a role asleep: on the host)."""
    import torch

    if hasattr(role, "memory_bytes"):  # an in-process vLLM engine: what it says it holds
        return role.memory_bytes()
    module = getattr(role, "module", None) or getattr(role, "model", None)
    if not isinstance(module, torch.nn.Module):
        return {}
    seen: set = set()
    out: dict[str, float] = {}
    device_only = on_gpu()  # GPU memory per GPU: offloaded or asleep states are on the host

    def add(key, t):
        if t is None or not torch.is_tensor(t) or t.numel() == 0 or (t.data_ptr(), t.numel()) in seen:
            return
        if device_only and t.device.type == "cpu":
            return
        seen.add((t.data_ptr(), t.numel()))
        out[key] = out.get(key, 0.0) + _nbytes(t)

    params = list(module.parameters())
    for p in params:
        for t in storage_tensors(local_tensor(p)):  # a quantized weight: its int8 data and its scales
            add(f"weights_{_dtype_name(t)}", t)
    engine = getattr(role, "engine", None)
    opt = getattr(engine, "optimizer", None) if getattr(role, "trainable", False) else None
    if opt is not None:
        masters = role.master_params()
        for t in masters:
            add("master", t)
        for t in role.grad_partitions():
            add("grads", t)
        for t in list(params) + list(masters):
            add("grads", t.grad)
        inner = torch_optimizer(opt)
        for state in getattr(inner, "state", {}).values():
            for t in state.values():
                if torch.is_tensor(t) and t.dim() > 0:
                    add("optimizer", t)
    for buf in module.buffers():
        add("other", buf)
    return out


class _SavedTensors:
    """Peak bytes autograd keeps for backward (storages counted once, parameters excluded)."""

    def __init__(self):
        self.live: dict[int, list] = {}  # storage ptr -> [bytes, refs]
        self.now = self.peak = 0

    def pack(self, t):
        if t.is_leaf and t.requires_grad:
            return t
        st = t.untyped_storage()
        key = st.data_ptr()
        if key not in self.live:
            self.live[key] = [st.nbytes(), 0]
            self.now += st.nbytes()
            self.peak = max(self.peak, self.now)
        self.live[key][1] += 1
        return _Held(t, self, key)

    @staticmethod
    def unpack(h):
        return h.t if isinstance(h, _Held) else h

    def release(self, key):
        entry = self.live.get(key)
        if entry is not None:
            entry[1] -= 1
            if entry[1] == 0:
                self.now -= entry[0]
                del self.live[key]


class _Held:
    __slots__ = ("t", "owner", "key")

    def __init__(self, t, owner, key):
        self.t, self.owner, self.key = t, owner, key

    def __del__(self):
        self.owner.release(self.key)


def _proc_status(key: str) -> float | None:
    """A `/proc/self/status` size in bytes (`VmRSS`, `VmHWM`), None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return float(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return None


def reset_peak() -> bool:
    """Start a new peak: torch's on a GPU; on CPU the kernel's high-water mark of this process's
    resident memory (`VmHWM`, reset by writing 5 to `/proc/self/clear_refs`, Linux >= 4.0). Returns
    whether a CPU peak can be read (`peak_rss`)."""
    import torch

    if on_gpu():
        torch.cuda.reset_peak_memory_stats()
        return True
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return _proc_status("VmHWM") is not None


def peak_rss() -> float | None:
    """Bytes: the most this process held resident since `reset_peak` (None where it cannot say)."""
    return _proc_status("VmHWM")


def process_memory() -> dict[str, float]:
    """Process-level numbers (bytes): on a GPU, torch's allocated peak and reserved pool, and the
    device's own used bytes (`mem_get_info`: vLLM's pool, which torch's allocator does not see, and
    any other process's too); RSS on CPU, and its peak since the last `reset_peak` (`rss_peak`: the
    phase's, under `MemoryTimer`)."""
    import torch

    if on_gpu():
        free, total = torch.cuda.mem_get_info()
        return {
            "cuda_peak": float(torch.cuda.max_memory_allocated()),
            "cuda_reserved": float(torch.cuda.memory_reserved()),
            "device_used": float(total - free),
        }
    import psutil

    out = {"rss": float(psutil.Process(os.getpid()).memory_info().rss)}
    peak = peak_rss()
    if peak is not None:
        out["rss_peak"] = peak
    return out


class MemoryTimer(Timer):
    """`Timer` that, at the end of each phase, accounts every role's tensors under the phase's stage
    (max over the step) and the process memory. With `track_activations`, the active role's
    saved-for-backward peak and its output logits are measured too (debug runs)."""

    def __init__(self, roles: dict, track_activations: bool = False, on_phase=None):
        super().__init__(on_phase)
        self.roles, self.track = roles, track_activations
        self.stages: dict[str, dict[str, dict[str, float]]] = {}

    @contextmanager
    def __call__(self, name: str, stage: str | None = None, role: str | None = None):
        """Time phase `name`; with `stage`, account memory under it (`role`: the one whose forward runs)."""
        active = role
        if stage is None:
            with super().__call__(name, stage, role):
                yield
            return
        import torch

        reset_peak()
        saved, logits, hooks = _SavedTensors(), [0], []
        tracked = self.track and active in self.roles
        if tracked:
            mod = getattr(self.roles[active], "module", None)
            if mod is not None:
                hooks.append(mod.register_forward_hook(lambda m, i, o: _max_logits(logits, o)))
                hooks += _track_checkpoint_inputs(mod, saved)
        ctx = torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack) if tracked else nullcontext()
        try:
            with super().__call__(name, stage, role), ctx:
                yield
        finally:
            for h in hooks:
                h.remove()
        self._record(stage, active, saved.peak if tracked else None, logits[0] if tracked else None)

    def _record(self, stage, active, acts, logits) -> None:
        rows = self.stages.setdefault(stage, {})
        for role_name, role in self.roles.items():
            snap = account_role(role)
            if role_name == active:  # zeros mean "not seen" (a no-grad forward saves nothing for backward)
                snap.update({k: float(v) for k, v in (("activations", acts), ("logits_buffer", logits)) if v})
            row = rows.setdefault(role_name, {})
            for k, v in snap.items():
                row[k] = max(row.get(k, 0.0), v)
        proc = rows.setdefault("process", {})
        for k, v in process_memory().items():
            proc[k] = max(proc.get(k, 0.0), v)

    floor_rss: float | None = None

    def floor(self) -> None:
        """The process's resident memory now, at the end of a step once its transient memory is released:
        `memory/floor/process/rss_mib`, what the next step starts from (CPU)."""
        if not on_gpu():
            self.floor_rss = process_memory()["rss"]

    def memory_metrics(self) -> dict[str, float]:
        """`memory/<stage>/<role>/<component>_mib` plus each role's `total_mib` (and the step's floor)."""
        out = {} if self.floor_rss is None else {"memory/floor/process/rss_mib": self.floor_rss / MIB}
        for stage, rows in self.stages.items():
            for role, comp in rows.items():
                for k, v in comp.items():
                    out[f"memory/{stage}/{role}/{k}_mib"] = v / MIB
                if role != "process":
                    out[f"memory/{stage}/{role}/total_mib"] = sum(comp.values()) / MIB
        return out


def _track_checkpoint_inputs(module, saved: _SavedTensors) -> list:
    """Checkpointed layers keep their input for the backward outside autograd's saved-tensor hooks
    (torch's checkpoint packs its own): count each such input as saved from the layer's forward until the
    next forward of `module` (its micro-batch's backward is done by then). The one layer recomputed in the
    backward stays unseen (the estimate counts it under `other`). Returns the hook handles."""
    from verl_ds.roles.base import checkpointed_modules

    layers = checkpointed_modules(module)
    if not layers:
        return []
    held: list = []
    state = {"forward": False}

    def begin(_m, _args):
        held.clear()  # the previous micro-batch's inputs: its backward has run
        state["forward"] = True

    def end(_m, _args, _out):
        state["forward"] = False

    def keep(_m, args, kwargs):
        x = args[0] if args else kwargs.get("hidden_states")
        if state["forward"] and torch.is_grad_enabled() and torch.is_tensor(x):  # not the backward's recompute
            held.append(saved.pack(x))

    import torch

    hooks = [module.register_forward_pre_hook(begin), module.register_forward_hook(end)]
    hooks += [m.register_forward_pre_hook(keep, with_kwargs=True) for m in layers]
    hooks.append(_Release(held))
    return hooks


class _Release:
    """A hook-like handle whose `remove` drops the held inputs at the end of the phase."""

    def __init__(self, held: list):
        self.held = held

    def remove(self) -> None:
        self.held.clear()


def _max_logits(box: list, out) -> None:
    t = getattr(out, "logits", out)
    import torch

    if torch.is_tensor(t):
        box[0] = max(box[0], _nbytes(t))


def stages_from_metrics(metrics: dict[str, float]) -> dict[str, dict[str, dict[str, float]]]:
    """Invert `memory_metrics` back into {stage: {role: {component: bytes}}} (totals dropped)."""
    out: dict = {}
    for key, v in metrics.items():
        parts = key.split("/")
        if len(parts) == 4 and parts[0] == "memory" and parts[3].endswith("_mib") and parts[3] != "total_mib":
            out.setdefault(parts[1], {}).setdefault(parts[2], {})[parts[3][:-4]] = v * MIB
    return out
