"""Analytic memory estimate per stage and role (pure math: no model is built).

Needs only the model's config.json, the rendered DeepSpeed configs, the resolved precision and the
batch sizes, so it answers "will it fit" for models that can't be built here (`verdict`).
Stages of one RL step: `rollout`, `score`, `update`, `sync`; components: `weights_<dtype>`,
`master`, `grads`, `optimizer`, `kv_cache`, `logits_buffer`, `activations`, `other`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from verl_ds.config import longest_row, offload_stages
from verl_ds.precision import INT8_ROLES, TORCH_DTYPES, TRAINED_ROLES, ds_dtype
from verl_ds.roles import attention, prefix
from verl_ds.rollout.engines.distributed import choose_engine

MIB = 2**20
GIB = 2**30
BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1}
STAGES = ("rollout", "score", "update", "sync")
STAGE_GROUPS = {"rollout": ("rollout", "score"), "train": ("update", "sync"), "all": STAGES}
COMPONENTS = ("weights", "master", "grads", "optimizer", "kv_cache", "logits_buffer", "activations", "other")
GPU_OVERHEAD_GIB = 1.0  # CUDA context + allocator slack per process (an assumption; measured varies)


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
    def from_hf_config(cls, c: dict) -> ModelShape:
        """A Llama/Qwen2/Mistral-style decoder from its HF config.json dict."""
        c = c.get("text_config", c)
        heads = c["num_attention_heads"]
        return cls(
            vocab=c["vocab_size"],
            hidden=c["hidden_size"],
            layers=c["num_hidden_layers"],
            heads=heads,
            kv_heads=c.get("num_key_value_heads") or heads,
            ffn=c["intermediate_size"],
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            tied=bool(c.get("tie_word_embeddings", False)),
            attn_bias=bool(c.get("attention_bias", c.get("model_type") == "qwen2")),
            mlp_bias=bool(c.get("mlp_bias", False)),
        )

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

    def lora_params(self, rank: int, targets) -> int:
        """Adapter parameters of LoRA rank `rank` on the named projections of every layer."""
        h, q, kv, f = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.ffn
        dims = {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, f),
            "up_proj": (h, f),
            "down_proj": (f, h),
        }
        return self.layers * sum(rank * (i + o) for t, (i, o) in dims.items() if t in set(targets))

    def largest_module(self) -> int:
        return max(self.vocab * self.hidden, self.layer_params())


@dataclass
class Workload:
    """Per-rank batch geometry of one step."""

    gen_batch: int  # sequences the rollout engine on this rank generates at once
    local_batch: int  # sequences of the rollout batch this rank scores and trains on
    seq_len: int  # prompt + response (upper bound)
    resp_len: int
    world: int = 1
    sp: int = 1  # `trainer.sequence_parallel_size`: each pass runs a 1/sp shard of every row
    shared_prefix: int = 0  # tokens the n rows of a group share (its prompt) and a pass runs once (`roles/prefix.py`)
    n: int = 1  # rows a group (`rollout.n`)
    min_saved: int = 0  # `model.share_prefix_min_tokens`

    def micro_batch(self, rows: int, hidden: int) -> tuple[int, int, int]:
        """(rows, tokens a row, scored tokens a row) one micro-batch of `rows` full-length rows runs: with
        shared prefixes, where `prefix.cheaper` says the shared pass runs, one sequence of each group's
        prompt once and every row's response, scoring every row's; else the rows as they are."""
        t, r = self.seq_len, self.resp_len
        if self.shared_prefix and rows > 1:
            shared = -(-rows // self.n) * self.shared_prefix + rows * (t - self.shared_prefix)
            if prefix.cheaper(shared, rows * t, rows * t * t, rows, hidden, self.min_saved):
                return 1, shared, rows * r
        return rows, t, r

    def run_tokens(self, rows: int, hidden: int) -> int:
        """Tokens one pass over this rank's rows runs, in micro-batches of `rows` (`micro_batch`)."""
        full, left = divmod(self.local_batch, rows)
        total = 0
        for k, times in ((rows, full), (left, int(left > 0))):
            b, t, _ = self.micro_batch(max(k, 1), hidden)
            total += times * b * t
        return total


def shares_prefixes(cfg) -> bool:
    """Whether the run's passes share prefixes (`roles.prefix.resolve_sharing`, before the attention is
    resolved: flash_attention_2 named, or flex_attention under sequence parallelism, turn it off)."""
    m = cfg.model
    flex_under_sp = m.attn_implementation == "flex_attention" and cfg.trainer.sequence_parallel_size > 1
    return m.share_prompt and m.attn_implementation != "flash_attention_2" and not flex_under_sp


def workload(cfg, world: int) -> Workload:
    total = cfg.trainer.prompts_per_step * cfg.rollout.n
    per_rank = total // world
    # one engine per tensor-parallel group: it generates for the group's ranks
    gen = per_rank * (cfg.rollout.tensor_parallel_size if cfg.rollout.engine == "vllm" else 1)
    t = longest_row(cfg)  # a multi-turn episode's row holds every turn
    sp = cfg.trainer.sequence_parallel_size  # a group's ranks hold its rows together, each split
    resp = max(1, t - cfg.data.max_prompt_length)
    share = shares_prefixes(cfg) and cfg.rollout.n > 1
    min_saved = prefix.min_saved_tokens(cfg.model.share_prefix_min_tokens, cfg.precision.actor_dtype)
    return Workload(gen, per_rank * sp, t, resp, world, sp, (t - resp) * share, cfg.rollout.n, min_saved)


# DeepSpeed's activation-checkpoint offload keeps the last layer's input and has two more in flight
# (`keep_last_count=1`, `max_fwd_stash_count=2`)
OFFLOAD_KEPT_LAYERS = 3


def pass_memory(
    shape: ModelShape,
    dtype: str,
    rows: int,
    t: int,
    r: int,
    *,
    head: str,
    grad: bool,
    grad_checkpointing: bool = False,
    math_attention: str = "",
    sp: int = 1,
    tiled_mlp: bool = False,
    offload_activations: bool = False,
) -> dict[str, float]:
    """Transient bytes of one micro-batch's pass over `rows` rows of `t` tokens, `r` of them scored
    (the response: logits only where they predict one, `logits_to_keep`): {activations, logits_buffer}.
    `sp` > 1 (sequence parallelism): the rank runs a `t / sp` shard of each row, scores the response
    tokens that fall in it (all of them on the last shard, at most the shard), and DeepSpeed's all-to-all
    holds one layer's query, keys, values and output in both layouts (`sp_buffers`); the core attention
    sees every token for `heads / sp` heads. `tiled_mlp` (DeepSpeed's TiledMLP): a layer's `ffn`-sized
    intermediates exist for one tile of `hidden` tokens at a time, in the forward and in the backward.
    `offload_activations` (with checkpointing, GPU): the layers' kept inputs wait on the host but for the
    few DeepSpeed's offload keeps or has in flight (`OFFLOAD_KEPT_LAYERS`).
    No grad: one layer's intermediates live at a time. Under grad every layer keeps what its backward
    needs (SwiGLU decoder), or with `grad_checkpointing` one input a layer plus one layer recomputed.
    `math_attention`: "backward": the backward recomputes the plain math (`roles/attention.py`: a 16-bit
    CPU pass under grad, rows short enough), one layer's [rows, heads, t, t] probabilities at a time (fp32
    softmax + its 16-bit copy), under `other`; "saved": eager attention keeps them in every layer; "":
    the fused kernels', linear in t (in the terms above)."""
    b = BYTES[dtype]
    h, kvdim, ffn = shape.hidden, shape.kv_heads * shape.head_dim, shape.ffn
    lm = head == "lm"
    # the math backward's one layer of probabilities (fp32 softmax and its 16-bit copy), a transient
    attn = rows * (shape.heads // sp) * t * t * (4 + b) if math_attention else 0.0
    split = {}
    if sp > 1:
        t = -(-t // sp)
        r = min(r, t)
        kv_rep = max(1, sp // shape.kv_heads)  # DeepSpeed repeats key/value heads fewer than the ranks
        split = {"sp_buffers": 2 * rows * t * (2 * h + 2 * kvdim * kv_rep) * b}
    out_logits = rows * (r if lm else t) * (shape.vocab if lm else 1) * b
    saved_attn = attn if math_attention == "saved" else 0.0
    attn -= saved_attn
    ffn_t = min(t, h) if tiled_mlp else t  # the tokens whose MLP intermediates exist at once
    if not grad:
        return {
            "activations": rows * (t * (4 * h + 2 * kvdim) + ffn_t * 3 * ffn) * b,
            "logits_buffer": out_logits + (rows * r * shape.vocab * 4 if lm else 0),  # + fp32 log-softmax
            **split,
        }
    # saved for backward, per token: ~12 hidden-sized values (norm inputs and outputs, q, the attention
    # output and its projection's input...), 5 kv-sized (k, v before and after rope), 5.5 ffn-sized (gate, up,
    # their activation and product): an upper bound of autograd's saved tensors of Llama layers measured
    # in fp32 and bf16, MHA and GQA (tests/roles/test_long_rows.py holds it against the measurement)
    per_layer = rows * (t * (24 * h + 10 * kvdim) + ffn_t * 11 * ffn) * b // 2 + saved_attn
    saved_logits = rows * r * shape.vocab * 4 * 3 if lm else 0  # fp32 logits, log-softmax, softmax (entropy)
    outside = rows * t * 3 * h * b + saved_logits  # the embedding's output, the final norm's input and output
    # the backward of one layer holds the gradients of its intermediates (about its saved set again), and
    # with checkpointing that set itself, recomputed: transients under `other`
    if grad_checkpointing:  # one input a layer kept
        kept = min(shape.layers, OFFLOAD_KEPT_LAYERS) if offload_activations else shape.layers
        acts = kept * rows * t * h * b
        return {"activations": acts + outside, "logits_buffer": out_logits, "other": 2 * per_layer + attn, **split}
    return {
        "activations": shape.layers * per_layer + outside,
        "logits_buffer": out_logits,
        "other": per_layer + attn,
        **split,
    }


def role_memory(
    shape: ModelShape,
    ds: dict,
    *,
    head: str,
    trainable: bool,
    w: Workload,
    grad_checkpointing: bool = False,
    weight_dtype: str | None = None,
    adapter_params: int = 0,
    math_attention: str = "",
    tiled_mlp: bool = False,
    offload_activations: bool = False,
) -> dict[str, dict[str, float]]:
    """One DeepSpeed role's bytes per stage: {stage: {component: bytes}} (resident in every stage,
    transient parts only in the stages that run this role: `pass_memory` of a micro-batch of
    `train_micro_batch_size_per_gpu` full-length rows). `adapter_params` > 0: a LoRA role whose
    frozen base adds only weights; masters, gradients and Adam states cover the adapters alone."""
    dtype = ds_dtype(ds)
    zero = ds.get("zero_optimization", {})
    stage, n = int(zero.get("stage", 0)), w.world
    base_psi = shape.params(head) + adapter_params
    psi = adapter_params or base_psi  # the trained parameters
    states = model_states(
        shape, ds, head=head, trainable=trainable, world=n, weight_dtype=weight_dtype, adapter_params=adapter_params
    )
    resident = dict(states["device"])
    grads = resident.pop("grads_update", 0.0)
    step_tmp = resident.pop("grads_fp32_update", 0.0)
    grad_dtype = ds.get("data_types", {}).get("grad_accum_dtype") or dtype
    mb = int(ds.get("train_micro_batch_size_per_gpu", 1))
    gathered = (
        (shape.largest_module() + min(base_psi, int(zero.get("stage3_prefetch_bucket_size", 5e7)))) * BYTES[dtype]
        if stage >= 3
        else 0.0
    )
    stages = {s: dict(resident) for s in STAGES}
    rows, t, r = w.micro_batch(mb, shape.hidden)  # a shared prefix once
    # every role runs a no-grad forward while scoring
    stages["score"].update(
        pass_memory(shape, dtype, rows, t, r, head=head, grad=False, sp=w.sp, tiled_mlp=tiled_mlp),
        other=gathered,
    )
    if trainable:
        bucket = min(psi, float(zero.get("reduce_bucket_size", 5e8))) * BYTES[grad_dtype] if stage in (1, 2) else 0.0
        train = pass_memory(
            shape,
            dtype,
            rows,
            t,
            r,
            head=head,
            grad=True,
            grad_checkpointing=grad_checkpointing,
            math_attention=math_attention,
            sp=w.sp,
            tiled_mlp=tiled_mlp,
            offload_activations=offload_activations,
        )
        recompute = train.pop("other", 0.0)
        stages["update"].update(
            train, grads=resident.get("grads", 0.0) + grads, other=gathered + step_tmp + bucket + recompute
        )
    return stages


def offloaded(ds: dict) -> tuple[bool, bool]:
    """(optimizer, parameters) offloaded to host memory by this rendered DeepSpeed config."""
    zero = ds.get("zero_optimization", {})

    def on_host(key: str) -> bool:
        return zero.get(key, {}).get("device", "none") in ("cpu", "nvme")

    stage = int(zero.get("stage", 0))
    return on_host("offload_optimizer") and stage >= 1, on_host("offload_param") and stage >= 3


def model_states(
    shape: ModelShape,
    ds: dict,
    *,
    head: str,
    trainable: bool,
    world: int,
    weight_dtype: str | None = None,
    adapter_params: int = 0,
) -> dict[str, dict[str, float]]:
    """One rank's model states, {"device": {...}, "host": {...}}: weights, fp32 masters, Adam states
    and gradients, placed as the DeepSpeed config says (ZeRO sharding, offload_optimizer: masters,
    Adam states and the fp32 gradient partition on the host; offload_param: the weight partition on
    the host). Device entries ending in `_update` exist only while the role updates (its gradients;
    the fp32 gradient copy the step makes)."""
    dtype = ds_dtype(ds)
    wdtype = weight_dtype or dtype
    stage, n = int(ds.get("zero_optimization", {}).get("stage", 0)), world
    off_opt, off_param = offloaded(ds)
    psi = shape.params(head) + adapter_params
    device, host = {}, {}
    (host if off_param else device)[f"weights_{wdtype}"] = psi * BYTES[wdtype] / (n if stage >= 3 else 1)
    psi = adapter_params or psi  # from here on: the trained parameters
    if trainable:
        opt_shard = n if stage >= 1 else 1
        grad_dtype = ds.get("data_types", {}).get("grad_accum_dtype") or dtype
        opt = host if off_opt else device
        # DeepSpeed's ZeRO optimizers clone an fp32 master partition even for fp32 models.
        opt["master"] = 4 * psi / opt_shard if (stage >= 1 or dtype != "fp32") else 0.0
        opt["optimizer"] = 8 * psi / opt_shard  # Adam exp_avg + exp_avg_sq, fp32
        grads = BYTES[grad_dtype] * psi / (n if stage >= 2 else 1)
        fp32_grads = 4 * psi / opt_shard if stage >= 1 or dtype != "fp32" else 0.0
        if off_opt:  # reduced gradients go to the host partition the CPU optimizer steps (stage >= 1)
            host["grads"] = fp32_grads
            if stage < 3:
                device["grads_update"] = grads  # backward still produces them on the device
        else:
            if stage >= 3:
                device["grads"] = grads  # ZeRO-3 keeps a persistent flat gradient partition buffer
            else:
                device["grads_update"] = grads
            device["grads_fp32_update"] = fp32_grads  # fp32 grad copy at step
    return {"device": device, "host": host}


def host_memory(cfg, shape: ModelShape, ds_configs: dict[str, dict], world: int, role_shapes=None) -> dict:
    """{role: {component: bytes}} one rank holds in host memory for its roles' model states
    (offloaded optimizers and parameters; nothing without offload)."""
    out = {}
    for role, ds in ds_configs.items():
        role_shape = (role_shapes or {}).get(role, shape)
        out[role] = model_states(role_shape, ds, **role_kwargs(cfg, role_shape, role), world=world)["host"]
    return out


def rollout_memory(
    shape: ModelShape,
    rcfg,
    dtype: str,
    w: Workload,
    actor_module_bytes: float,
    gpu_gib: float | None,
    weights_bytes: float,
) -> dict[str, dict[str, float]]:
    """The generation engine: full weights (TP=1) + KV cache, resident in every stage for vLLM (its
    pool is reserved at start; on GPU, weights + pool = gpu_memory_utilization x the GPU) unless it
    sleeps (GPU `rollout.sleep`: nothing while the roles score and train, only the weights in the
    sync: `VLLMRollout.sleep`), only during `rollout` for HF generate (then the whole batch's cache)."""
    b = BYTES[dtype]
    kv_need = 2 * shape.layers * shape.kv_heads * shape.head_dim * b * w.gen_batch * w.seq_len
    buffer = w.gen_batch * w.seq_len * (8 + 4 + 4 + 4) + w.gen_batch * shape.vocab * 4  # ids, masks, logprobs
    weights = {f"weights_{dtype}": float(weights_bytes)}
    if rcfg.engine == "vllm":  # vLLM schedules sequences into its pool: the pool, not the batch, sets the size
        pool = (rcfg.gpu_memory_utilization * gpu_gib * GIB - weights_bytes) if gpu_gib else rcfg.kv_cache_gb * GIB
        base = {**weights, "kv_cache": max(pool, 0.0)}
        stages = {s: dict(base) for s in STAGES}
        if gpu_gib and rcfg.sleep:  # asleep while the roles score and train; the sync wakes the weights only
            stages["score"], stages["update"] = {}, {}
            stages["sync"] = dict(weights)
    else:
        stages = {s: dict(weights) for s in STAGES}
        stages["rollout"]["kv_cache"] = kv_need
    stages["rollout"]["logits_buffer"] = buffer
    # one gathered module + one bucket (never more than the whole model)
    stages["sync"]["other"] = min(rcfg.bucket_mb * MIB, weights_bytes) + actor_module_bytes
    return stages


def sender_memory(shape: ModelShape, actor_ds: dict, gpu_gib: float | None) -> dict[str, dict[str, float]]:
    """A trainer rank's part of the weights' way to the rollout ranks apart (`trainer.rollout_ranks`,
    `RemoteRollout.sync_weights`): the sync gathers one module at a time to the device; trainer rank 0 keeps
    on the host a copy of what it last sent, in the actor's dtype (what the next sync's changed elements are
    found against), and serializes the sync's message (the changed elements, at most the weights) whole. On
    a CPU the host is the device: both count; on a GPU they are host memory, off the estimate."""
    weights = float(shape.params("lm") * BYTES[ds_dtype(actor_ds)]) if actor_ds else 0.0
    on_host = 0.0 if gpu_gib else weights
    stages = {s: ({"weights_sent": on_host} if on_host else {}) for s in STAGES}
    stages["sync"]["other"] = on_host + shape.largest_module() * 4
    return stages


HEADS = {"actor": "lm", "reference": "lm", "critic": "value", "reward": "score", "teacher": "lm"}


def role_kwargs(cfg, shape: ModelShape, role: str) -> dict:
    """What the run config says about a role's model states: its head, whether it trains, int8
    weights (reward model, teacher), LoRA adapters (the actor)."""
    lora = cfg.model.lora
    return dict(
        head=HEADS[role],
        trainable=role in TRAINED_ROLES,
        weight_dtype="int8" if role in INT8_ROLES and cfg.precision.role_dtype(role) == "int8" else None,
        adapter_params=shape.lora_params(lora.rank, lora.target_modules) if role == "actor" and lora.rank else 0,
    )


def run_role_memory(
    cfg, shape: ModelShape, role: str, ds: dict, w: Workload, on_gpu: bool = False
) -> dict[str, dict[str, float]]:
    """`role_memory` with what the run config says about this role (`role_kwargs`, activation
    checkpointing; on a GPU, `roles.<role>.sleep`: nothing of it on the device while generating)."""
    rows, t, _ = w.micro_batch(int(ds.get("train_micro_batch_size_per_gpu", 1)), shape.hidden)
    stages = role_memory(
        shape,
        ds,
        **role_kwargs(cfg, shape, role),
        w=w,
        grad_checkpointing=cfg.precision.enable_grad_checkpointing,
        math_attention=math_attention(cfg, role, ds_dtype(ds), rows, t, on_gpu),
        tiled_mlp=getattr(cfg.roles, role).tiled_mlp,
        offload_activations=on_gpu and getattr(cfg.roles, role).offload_activations,
    )
    if on_gpu and getattr(cfg.roles, role).sleep and role in TRAINED_ROLES:
        stages["rollout"] = {}
    return stages


def math_attention(cfg, role: str, dtype: str, rows: int, t: int, on_gpu: bool) -> str:
    """How `role`'s training pass over `rows` rows of `t` tokens runs the plain attention math: "saved"
    (`eager`: every layer keeps its probabilities), "backward" (on CPU `sdpa_cpu16`, `auto`: a 16-bit
    pass of short rows recomputes one layer's in the backward), "" (fused kernels)."""
    impl = cfg.model.attn_implementation
    if HEADS[role] != "lm" or role not in TRAINED_ROLES:
        return ""
    if impl == "eager":
        return "saved"
    cpu16 = impl in ("auto", attention.NAME) and not on_gpu
    return "backward" if cpu16 and attention.math_runs(TORCH_DTYPES[dtype], "cpu", rows, t, t) else ""


def roles_memory(
    cfg,
    shape: ModelShape,
    ds_configs: dict[str, dict],
    world: int,
    gpu_gib: float | None = None,
    role_shapes: dict[str, ModelShape] | None = None,
) -> dict[str, dict[str, dict[str, float]]]:
    """{role: {stage: {component: bytes}}} per GPU: the DeepSpeed roles alone (`estimate_memory`'s
    arguments; the rollout engine's settings do not enter)."""
    w = workload(cfg, world)
    return {
        role: run_role_memory(cfg, (role_shapes or {}).get(role, shape), role, ds, w, on_gpu=bool(gpu_gib))
        for role, ds in ds_configs.items()
    }


def estimate_memory(
    cfg,
    shape: ModelShape,
    ds_configs: dict[str, dict],
    world: int,
    rollout_dtype: str,
    gpu_gib: float | None = None,
    role_shapes: dict[str, ModelShape] | None = None,
    roles_part: dict | None = None,
) -> dict[str, dict[str, dict[str, float]]]:
    """{stage: {role: {component: bytes}}} per GPU: one rank's roles and its colocated rollout engine
    (every rank owns one; a tensor-parallel group shares one, split over its ranks; apart, a trainer
    rank's part of the weights' way to the rollout ranks instead, `sender_memory`). `role_shapes`:
    the roles whose model is not the policy's (a reward model, a larger teacher). `roles_part`: the
    roles' `roles_memory` for these arguments, where a caller varies only the engine's settings."""
    if cfg.rollout.engine == "auto":  # the engine the trainer would pick for this model and device
        engine = choose_engine("auto", shape.params("lm"), bool(gpu_gib), cfg.trainer.sequence_parallel_size)[0]
        cfg = replace(cfg, rollout=replace(cfg.rollout, engine=engine))
    w = workload(cfg, world)
    per_role = dict(roles_part or roles_memory(cfg, shape, ds_configs, world, gpu_gib, role_shapes))
    rdt = rollout_dtype
    if cfg.trainer.rollout_ranks:  # apart: the engine is on a rollout rank (`rollout_memory` is its memory)
        per_role["rollout"] = sender_memory(shape, ds_configs.get("actor", {}), gpu_gib)
    else:
        per_role["rollout"] = rollout_memory(
            shape, cfg.rollout, rdt, w, shape.largest_module() * 4, gpu_gib, shape.params("lm") * BYTES[rdt]
        )
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


def choose_zero_stages(
    cfg,
    shape: ModelShape,
    ds_configs: dict[str, dict],
    world: int,
    budget_bytes: float,
    auto_roles: list[str],
    headroom: float = 0.8,
    role_shapes: dict[str, ModelShape] | None = None,
) -> dict[str, int]:
    """`zero_stage: auto`: for each role in `auto_roles`, the lowest ZeRO stage (0-3; frozen roles
    0 or 3; one its offload allows; >= 1 for a role that sleeps) at which every role's peak
    estimate, summed, fits `headroom` x `budget_bytes`. Roles not yet decided count at stage 3.
    ZeRO-3 when nothing fits."""
    import copy

    w = workload(cfg, world)
    chosen = {r: 3 for r in auto_roles}

    def peak(stages: dict[str, int]) -> float:
        totals = {s: 0.0 for s in STAGES}
        for role, ds in ds_configs.items():
            ds = copy.deepcopy(ds)
            if role in stages:
                ds.setdefault("zero_optimization", {})["stage"] = stages[role]
            mem = run_role_memory(cfg, (role_shapes or {}).get(role, shape), role, ds, w)
            for s in STAGES:
                totals[s] += sum(mem[s].values())
        return max(totals.values())

    for role in auto_roles:
        rc = getattr(cfg.roles, role)
        for stage in offload_stages(rc.offload, role in TRAINED_ROLES, rc.sleep):
            if peak({**chosen, role: stage}) <= headroom * budget_bytes:
                chosen[role] = stage
                break
    return chosen


CPU_PROCESS_GIB = 1.0  # a CPU rank's interpreter, libraries and buffers outside the model (an assumption)


@dataclass(frozen=True)
class PassFit:
    """How one role's heaviest pass (the update for a trained role, else its scoring) fits one rank."""

    role: str
    stage: str  # "update" | "score"
    row_tokens: int  # the longest row the run can make
    row_bytes: float  # that pass's transient bytes for one such row (`pass_memory`)
    resident_bytes: float  # everything else the rank holds in that stage (model states, rollout, process)
    budget_bytes: float  # the rank's memory

    def rows(self, headroom: float = 1.0) -> int:
        """Full-length rows one micro-batch of this pass fits in `headroom` x the rank's memory."""
        return max(0, int((headroom * self.budget_bytes - self.resident_bytes) // self.row_bytes))

    def tokens(self, headroom: float = 1.0) -> int:
        """Tokens one micro-batch of this pass fits, a row's bytes taken as linear in its tokens."""
        per_token = self.row_bytes / max(self.row_tokens, 1)
        return max(0, int((headroom * self.budget_bytes - self.resident_bytes) // per_token))


def fit_passes(
    cfg,
    shape: ModelShape,
    ds_configs: dict[str, dict],
    world: int,
    rollout_dtype: str,
    budget_bytes: float,
    gpu_gib: float | None = None,
    role_shapes: dict[str, ModelShape] | None = None,
) -> dict[str, PassFit]:
    """Each role's heaviest pass against this rank's memory: what the stage holds besides transient
    activations and logits (every role's model states, the rollout engine, the process), and what one
    full-length row of the pass adds."""
    est = estimate_memory(cfg, shape, ds_configs, world, rollout_dtype, gpu_gib, role_shapes)
    transient = ("activations", "logits_buffer", "sp_buffers")
    w = workload(cfg, world)

    def pass_of(role: str, stage: str, n: int) -> dict[str, float]:
        ds, s = ds_configs[role], (role_shapes or {}).get(role, shape)
        rows, t, r = w.micro_batch(n, s.hidden)  # as `role_memory` counts it: a shared prefix once
        return pass_memory(
            s,
            ds_dtype(ds),
            rows,
            t,
            r,
            head=HEADS[role],
            grad=stage == "update" and role in TRAINED_ROLES,
            grad_checkpointing=cfg.precision.enable_grad_checkpointing,
            math_attention=math_attention(cfg, role, ds_dtype(ds), rows, t, bool(gpu_gib)),
            sp=w.sp,
            tiled_mlp=getattr(cfg.roles, role).tiled_mlp,
            offload_activations=bool(gpu_gib) and getattr(cfg.roles, role).offload_activations,
        )

    def rows(role: str) -> int:
        return int(ds_configs[role].get("train_micro_batch_size_per_gpu", 1))

    out = {}
    for role in ds_configs:
        stage = "update" if role in TRAINED_ROLES else "score"
        # the stage's states and buffers without any role's pass transients (the passes run one at a time)
        resident = sum(v for comp in est[stage].values() for k, v in comp.items() if k not in transient)
        resident -= sum(pass_of(r, stage, rows(r)).get("other", 0.0) for r in ds_configs)
        resident += 0.0 if gpu_gib else CPU_PROCESS_GIB * GIB
        one = pass_of(role, stage, 1)
        out[role] = PassFit(role, stage, w.seq_len, sum(one.values()), resident, budget_bytes)
    return out
