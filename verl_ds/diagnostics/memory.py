"""Memory per stage and role: an analytic estimate (pure math) and a measured account.

Stages of one RL step: `rollout` (generation), `score` (old/ref logprobs, values, reward model),
`update` (actor and critic forward/backward/step), `sync` (actor weights into the rollout engine).
Components: `weights_<dtype>`, `master`, `grads`, `optimizer`, `kv_cache`, `logits_buffer`
(logits and the rollout buffer), `activations`, `other`.

- `estimate_memory(...)` needs only the model's config.json, the rendered DeepSpeed configs and the
  batch sizes, so it answers "will it fit" for models that can't be built here (`verdict`).
- `MemoryTimer` is a `Timer` that also accounts every role's tensors at the end of each trainer
  phase (params by dtype, fp32 master partitions, grads, optimizer states; optionally the peak
  bytes autograd keeps for backward) plus the process RSS / CUDA peak. The trainer logs it as
  `memory/<stage>/<role>/<component>_mib`.
- `memory_table` / `compare_table` render Markdown.
"""
from __future__ import annotations

import math
import os
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

from verl_ds.diagnostics.metrics import Timer
from verl_ds.precision import ds_dtype

MIB = 2 ** 20
GIB = 2 ** 30
BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1}
STAGES = ("rollout", "score", "update", "sync")
STAGE_GROUPS = {"rollout": ("rollout", "score"), "train": ("update", "sync"), "all": STAGES}
COMPONENTS = ("weights", "master", "grads", "optimizer", "kv_cache", "logits_buffer", "activations", "other")
# trainer timer phase -> (stage, the role whose forward runs in it)
PHASES = {"gen": ("rollout", "rollout"), "reward": ("score", "reward"), "old_logprob": ("score", "actor"),
          "ref": ("score", "reference"), "values": ("score", "critic"), "update_actor": ("update", "actor"),
          "update_critic": ("update", "critic"), "update_weights": ("sync", "actor")}
GPU_OVERHEAD_GIB = 1.0  # CUDA context + allocator slack per process (an assumption; measured varies)


# ============================================================== analytic estimate (pure)

@dataclass
class ModelShape:
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    head_dim: int
    tied: bool = False
    attn_bias: bool = False
    mlp_bias: bool = False

    @classmethod
    def from_hf_config(cls, c: dict) -> "ModelShape":
        """A Llama/Qwen2/Mistral-style decoder from its HF config.json dict."""
        c = c.get("text_config", c)
        heads = c["num_attention_heads"]
        return cls(vocab=c["vocab_size"], hidden=c["hidden_size"], layers=c["num_hidden_layers"], heads=heads,
                   kv_heads=c.get("num_key_value_heads") or heads, ffn=c["intermediate_size"],
                   head_dim=c.get("head_dim") or c["hidden_size"] // heads,
                   tied=bool(c.get("tie_word_embeddings", False)),
                   attn_bias=bool(c.get("attention_bias", c.get("model_type") == "qwen2")),
                   mlp_bias=bool(c.get("mlp_bias", False)))

    def layer_params(self) -> int:
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.attn_bias else 0)
        mlp = 3 * h * self.ffn + ((2 * self.ffn + h) if self.mlp_bias else 0)
        return attn + mlp + 2 * h  # + two RMSNorms

    def params(self, head: str = "lm") -> int:
        """Parameter count: `lm` (causal LM), `value` (backbone + scalar head), `score` (classifier)."""
        body = self.vocab * self.hidden + self.layers * self.layer_params() + self.hidden
        if head == "lm":
            return body + (0 if self.tied else self.vocab * self.hidden)
        return body + self.hidden + (1 if head == "value" else 0)

    def largest_module(self) -> int:
        return max(self.vocab * self.hidden, self.layer_params())


@dataclass
class Workload:
    """Per-rank batch geometry of one step."""
    gen_batch: int           # sequences the rollout engine on this rank generates at once
    local_batch: int         # sequences of the rollout batch this rank scores and trains on
    seq_len: int             # prompt + response (upper bound)
    resp_len: int
    world: int = 1


def workload(cfg, world: int) -> Workload:
    total = cfg.trainer.prompts_per_step * cfg.rollout.n
    per_rank = total // world
    gen = per_rank if (cfg.rollout.per_rank or cfg.rollout.engine == "hf") else total
    return Workload(gen, per_rank, cfg.data.max_prompt_length + cfg.rollout.max_new_tokens,
                    cfg.rollout.max_new_tokens, world)


def role_memory(shape: ModelShape, ds: dict, *, head: str, trainable: bool, w: Workload,
                grad_checkpointing: bool = False, weight_dtype: str | None = None) -> dict[str, dict[str, float]]:
    """One DeepSpeed role's bytes per stage: {stage: {component: bytes}} (resident in every stage,
    transient parts only in the stages that run this role)."""
    dtype = ds_dtype(ds)
    wdtype = weight_dtype or dtype
    b = BYTES[dtype]
    zero = ds.get("zero_optimization", {})
    stage, n = int(zero.get("stage", 0)), w.world
    psi = shape.params(head)
    resident = {f"weights_{wdtype}": psi * BYTES[wdtype] / (n if stage >= 3 else 1)}
    if trainable:
        opt_shard = n if stage >= 1 else 1
        grad_dtype = ds.get("data_types", {}).get("grad_accum_dtype") or dtype
        # DeepSpeed's ZeRO optimizers clone an fp32 master partition even for fp32 models.
        resident["master"] = 4 * psi / opt_shard if (stage >= 1 or dtype != "fp32") else 0.0
        resident["optimizer"] = 8 * psi / opt_shard  # Adam exp_avg + exp_avg_sq, fp32
        grads = BYTES[grad_dtype] * psi / (n if stage >= 2 else 1)
        if stage >= 3:
            resident["grads"] = grads  # ZeRO-3 keeps a persistent flat gradient partition buffer
    mb = int(ds.get("train_micro_batch_size_per_gpu", 1))
    t, r, h, v = w.seq_len, w.resp_len, shape.hidden, shape.vocab
    kvdim = shape.kv_heads * shape.head_dim
    gathered = (shape.largest_module() + min(psi, int(zero.get("stage3_prefetch_bucket_size", 5e7)))) * b \
        if stage >= 3 else 0.0
    out_logits = mb * t * (v if head == "lm" else 1) * b
    # no-grad forward: one layer's intermediates live at a time; logits + fp32 log-softmax of the response
    fwd = {"activations": mb * t * (4 * h + 2 * kvdim + 3 * shape.ffn) * b,
           "logits_buffer": out_logits + (mb * r * v * 4 if head == "lm" else 0), "other": gathered}
    stages = {s: dict(resident) for s in STAGES}
    stages["score"].update(fwd)  # every role runs a no-grad forward while scoring
    if trainable:
        per_layer = mb * t * (10 * h + 4 * kvdim + 5 * shape.ffn) * b  # saved for backward (SwiGLU decoder)
        acts = (shape.layers * mb * t * h * b + per_layer) if grad_checkpointing else shape.layers * per_layer
        saved_logits = mb * r * v * 4 * 3 if head == "lm" else 0  # fp32 logits, log-softmax, softmax (entropy)
        step_tmp = 4 * psi / (n if stage >= 1 else 1) if stage >= 1 or dtype != "fp32" else 0.0  # fp32 grad copy at step
        bucket = min(psi, float(zero.get("reduce_bucket_size", 5e8))) * BYTES[grad_dtype] if stage in (1, 2) else 0.0
        stages["update"].update(grads=grads, activations=acts + saved_logits, logits_buffer=out_logits,
                                other=gathered + step_tmp + bucket)
    return stages


def rollout_memory(shape: ModelShape, rcfg, dtype: str, w: Workload, actor_module_bytes: float,
                   gpu_gib: float | None, weights_bytes: float) -> dict[str, dict[str, float]]:
    """The generation engine: full weights (TP=1) + KV cache, resident in every stage for vLLM (its
    pool is reserved at start and not released; on GPU, weights + pool = gpu_memory_utilization x
    the GPU), only during `rollout` for HF generate (then the whole batch's cache)."""
    b = BYTES[dtype]
    kv_need = 2 * shape.layers * shape.kv_heads * shape.head_dim * b * w.gen_batch * w.seq_len
    buffer = w.gen_batch * w.seq_len * (8 + 4 + 4 + 4) + w.gen_batch * shape.vocab * 4  # ids, masks, logprobs
    weights = {f"weights_{dtype}": float(weights_bytes)}
    if rcfg.engine == "vllm":  # vLLM schedules sequences into its pool: the pool, not the batch, sets the size
        pool = (rcfg.gpu_memory_utilization * gpu_gib * GIB - weights_bytes) if gpu_gib else rcfg.kv_cache_gb * GIB
        base = {**weights, "kv_cache": max(pool, 0.0)}
        stages = {s: dict(base) for s in STAGES}
    else:
        stages = {s: dict(weights) for s in STAGES}
        stages["rollout"]["kv_cache"] = kv_need
    stages["rollout"]["logits_buffer"] = buffer
    # one gathered module + one bucket (never more than the whole model)
    stages["sync"]["other"] = min(rcfg.bucket_mb * MIB, weights_bytes) + actor_module_bytes
    return stages


def estimate_memory(cfg, shape: ModelShape, ds_configs: dict[str, dict], world: int,
                    gpu_gib: float | None = None, reward_shape: ModelShape | None = None
                    ) -> dict[str, dict[str, dict[str, float]]]:
    """{stage: {role: {component: bytes}}} per GPU (rank 0, which also hosts the rollout engine)."""
    w = workload(cfg, world)
    gc = cfg.precision.enable_grad_checkpointing
    heads = {"actor": "lm", "reference": "lm", "critic": "value", "reward": "score"}
    per_role = {}
    for role, ds in ds_configs.items():
        wdt = "int8" if role == "reward" and cfg.precision.reward_dtype == "int8" else None
        per_role[role] = role_memory((reward_shape or shape) if role == "reward" else shape, ds, head=heads[role],
                                     trainable=role in ("actor", "critic"), w=w, grad_checkpointing=gc,
                                     weight_dtype=wdt)
    rdt = cfg.precision.rollout_dtype
    rdt = rdt if rdt != "auto" else ds_dtype(ds_configs["actor"])
    per_role["rollout"] = rollout_memory(shape, cfg.rollout, rdt, w, shape.largest_module() * 4, gpu_gib,
                                         shape.params("lm") * BYTES[rdt])
    if gpu_gib:
        per_role["process"] = {s: {"other": GPU_OVERHEAD_GIB * GIB} for s in STAGES}
    return {s: {role: per_role[role][s] for role in per_role} for s in STAGES}


def stage_totals(est: dict) -> dict[str, float]:
    return {s: sum(sum(c.values()) for c in roles.values()) for s, roles in est.items()}


def verdict(est: dict, gpu_gib: float) -> tuple[bool, str, float]:
    """(fits, peak stage, peak bytes) against a GPU of `gpu_gib` GiB."""
    totals = stage_totals(est)
    peak_stage = max(totals, key=totals.get)
    return totals[peak_stage] <= gpu_gib * GIB, peak_stage, totals[peak_stage]


def peak_by_role(stages: dict) -> dict[str, dict[str, float]]:
    """For each role, its components at the stage where the role's total peaks (`peak_memory`)."""
    out: dict[str, dict[str, float]] = {}
    for roles in stages.values():
        for role, comp in roles.items():
            if sum(comp.values()) >= sum(out.get(role, {}).values()):
                out[role] = dict(comp)
    return out


# ============================================================== measurement

def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def _dtype_name(t) -> str:
    return {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "int8": "int8", "qint8": "int8"}.get(
        str(t.dtype).replace("torch.", ""), str(t.dtype).replace("torch.", ""))


def account_role(role) -> dict[str, float]:
    """Bytes a role's tensors hold now: weights by dtype (ZeRO-3: this rank's partition), fp32 master
    partitions, gradients, optimizer states. A tensor counted once (first category wins)."""
    import torch

    module = getattr(role, "module", None) or getattr(role, "model", None)
    if not isinstance(module, torch.nn.Module):
        return {}  # e.g. a vLLM engine in another process
    seen: set = set()
    out: dict[str, float] = {}

    def add(key, t):
        if t is None or not torch.is_tensor(t) or t.numel() == 0 or (t.data_ptr(), t.numel()) in seen:
            return
        seen.add((t.data_ptr(), t.numel()))
        out[key] = out.get(key, 0.0) + _nbytes(t)

    params = list(module.parameters())
    for p in params:
        t = getattr(p, "ds_tensor", None)
        t = t if t is not None else p.data
        add(f"weights_{_dtype_name(t)}", t)
    from verl_ds.roles.reward import tensor_bytes  # int8 packed weights live outside parameters()
    packed = tensor_bytes(module) - sum(_nbytes(p) for p in params) - sum(_nbytes(b) for b in module.buffers())
    if packed > 0:
        out["weights_int8"] = out.get("weights_int8", 0.0) + packed
    engine = getattr(role, "engine", None)
    opt = getattr(engine, "optimizer", None) if getattr(role, "trainable", False) else None
    if opt is not None:
        for t in role._master_params():
            add("master", t)
        for t in role._grad_partitions():
            add("grads", t)
        for t in list(params) + list(role._master_params()):
            add("grads", t.grad)
        inner = getattr(opt, "optimizer", opt)
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
        self.live: dict[int, list] = {}   # storage ptr -> [bytes, refs]
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


def process_memory() -> dict[str, float]:
    """Process-level numbers: CUDA allocated/peak on GPU, RSS on CPU (bytes)."""
    import torch

    if torch.cuda.is_available():
        return {"cuda_peak": float(torch.cuda.max_memory_allocated()),
                "cuda_reserved": float(torch.cuda.memory_reserved())}
    import psutil

    return {"rss": float(psutil.Process(os.getpid()).memory_info().rss)}


class MemoryTimer(Timer):
    """`Timer` that, at the end of each phase, accounts every role's tensors under the phase's stage
    (max over the step) and the process memory. With `track_activations`, the active role's
    saved-for-backward peak and its output logits are measured too (debug runs)."""

    def __init__(self, roles: dict, track_activations: bool = False):
        super().__init__()
        self.roles, self.track = roles, track_activations
        self.stages: dict[str, dict[str, dict[str, float]]] = {}

    @contextmanager
    def __call__(self, name: str):
        stage, active = PHASES.get(name, (None, None))
        if stage is None:
            with super().__call__(name):
                yield
            return
        import torch

        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        saved, logits, hooks = _SavedTensors(), [0], []
        tracked = self.track and active in self.roles
        if tracked:
            mod = getattr(self.roles[active], "module", None)
            if mod is not None:
                hooks.append(mod.register_forward_hook(lambda m, i, o: _max_logits(logits, o)))
        ctx = torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack) if tracked else nullcontext()
        try:
            with super().__call__(name), ctx:
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

    def memory_metrics(self) -> dict[str, float]:
        """`memory/<stage>/<role>/<component>_mib` plus each role's `total_mib`."""
        out = {}
        for stage, rows in self.stages.items():
            for role, comp in rows.items():
                for k, v in comp.items():
                    out[f"memory/{stage}/{role}/{k}_mib"] = v / MIB
                if role != "process":
                    out[f"memory/{stage}/{role}/total_mib"] = sum(comp.values()) / MIB
        return out


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


# ============================================================== Markdown

def fmt_bytes(x: float | None) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    for unit, div in (("GiB", GIB), ("MiB", MIB), ("KiB", 1024)):
        if abs(x) >= div:
            return f"{x / div:.2f} {unit}"
    return f"{x:.0f} B"


def md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * len(header)) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def _components(*dicts) -> list[str]:
    keys = {k for d in dicts for k in d}
    order = {c: i for i, c in enumerate(COMPONENTS)}
    return sorted(keys, key=lambda k: (order.get("weights" if k.startswith("weights") else k, 99), k))


def memory_table(est: dict, measured: dict | None, stages=STAGES) -> str:
    """One Markdown table per stage: role | component | estimate | measured."""
    out = []
    for s in stages:
        e_roles, m_roles = est.get(s, {}), (measured or {}).get(s, {})
        rows = []
        for role in list(e_roles) + [r for r in m_roles if r not in e_roles]:
            e, m = e_roles.get(role, {}), m_roles.get(role, {})
            for c in _components(e, m):
                rows.append([role, c, fmt_bytes(e.get(c)), fmt_bytes(m.get(c)) if measured else "n/a"])
            if role != "process":
                rows.append([role, "**total**", fmt_bytes(sum(e.values())),
                             fmt_bytes(sum(m.values())) if m else "n/a"])
        rows.append(["**all roles**", "**total**", fmt_bytes(stage_totals({s: e_roles})[s]),
                     fmt_bytes(sum(sum(c.values()) for r, c in m_roles.items() if r != "process")) if m_roles else "n/a"])
        out.append(f"### stage: {s}\n\n" + md_table(["role", "component", "estimate", "measured"], rows))
    return "\n\n".join(out)


def _merge_weights(comp: dict) -> tuple[dict, str]:
    """`weights_<dtype>` entries -> one `weights` entry, and the dtype label."""
    dts = [k[len("weights_"):] for k in comp if k.startswith("weights_")]
    out = {k: v for k, v in comp.items() if not k.startswith("weights_")}
    if dts:
        out["weights"] = sum(comp[f"weights_{d}"] for d in dts)
    return out, "+".join(dts)


def compare_table(a: dict, b: dict, names=("a", "b")) -> str:
    """Per role and component: a | b | delta (b - a) | ratio (b / a). Inputs: {role: {component: bytes}}."""
    rows = []
    for role in list(a) + [r for r in b if r not in a]:
        (ra, da), (rb, db) = _merge_weights(a.get(role, {})), _merge_weights(b.get(role, {}))
        for c in _components(ra, rb) + ["total"]:
            va = sum(ra.values()) if c == "total" else ra.get(c, 0.0)
            vb = sum(rb.values()) if c == "total" else rb.get(c, 0.0)
            ratio = f"{vb / va:.2f}" if va else "n/a"
            label = f"weights ({da} → {db})" if c == "weights" and da != db else c
            rows.append([role, label, fmt_bytes(va), fmt_bytes(vb),
                         ("+" if vb >= va else "-") + fmt_bytes(abs(vb - va)), ratio])
    return md_table(["role", "component", names[0], names[1], "delta", "ratio"], rows)


# ============================================================== report (used by `verl-ds debug memory`)

def load_shape(config_json: str) -> ModelShape:
    import json
    from pathlib import Path

    from verl_ds.errors import ConfigError

    p = Path(config_json)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ConfigError("--model-config", f"HF config.json not found: {p}")
    try:
        return ModelShape.from_hf_config(json.loads(p.read_text()))
    except (KeyError, json.JSONDecodeError) as e:
        raise ConfigError(str(p), f"not a decoder config.json this estimate understands ({e})") from None


def report(cfg, shape: ModelShape, world: int, stage: str = "all", measured: dict | None = None,
           gpu_gib: float | None = None) -> str:
    """The Markdown `debug memory` prints: a header, one table per stage, and the verdict."""
    from verl_ds.config import render_ds_configs

    est = estimate_memory(cfg, shape, render_ds_configs(cfg, world), world, gpu_gib)
    stages = STAGE_GROUPS.get(stage, (stage,))
    dt = {r: ds_dtype(ds) for r, ds in render_ds_configs(cfg, world).items()}
    head = (f"## Memory per GPU: {shape.params('lm') / 1e6:.2f}M-parameter model, world size {world}, "
            f"rollout {cfg.rollout.engine}, dtypes {dt}\n\n"
            "Estimate: analytic, from the model config, the DeepSpeed configs and the batch sizes (sequence "
            "length = max_prompt_length + max_new_tokens, an upper bound). Measured: "
            + ("tensor accounting during one real step (first step: optimizer states appear at the first "
               "optimizer step; activations = peak bytes saved for backward)." if measured else "n/a (not built)."))
    text = head + "\n\n" + memory_table(est, measured, stages)
    if gpu_gib:
        ok, peak_stage, peak = verdict({s: est[s] for s in stages}, gpu_gib)
        text += (f"\n\n**Verdict: {'fits' if ok else 'does NOT fit'}** on one {gpu_gib:g} GiB GPU per rank: "
                 f"estimated peak {fmt_bytes(peak)} in stage `{peak_stage}` "
                 f"(includes {GPU_OVERHEAD_GIB:g} GiB CUDA context/allocator allowance).")
    return text
