"""The interface every role implements: one DeepSpeed engine built from the role's rendered config.

Roles know nothing of rollout or the training loop. Backward and step always go through the
engine; what they read of DeepSpeed's internals (the reduced gradient partitions for overflow
alignment and the fp16 underflow statistic, the fp32 masters, the loss scale, and for fp32 ZeRO-0
on CPU the switch that leaves the gradient all-reduce to `dist.BucketAllReduce`) goes through
`roles/ds_internals.py`.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass

import torch

from verl_ds.dist import BucketAllReduce, all_reduce_max, all_reduce_sum, init_distributed, on_gpu
from verl_ds.precision import TORCH_DTYPES, ds_dtype
from verl_ds.roles import ds_internals as dsi
from verl_ds.roles import prefix
from verl_ds.roles.batch import TrainBatch
from verl_ds.roles.long_rows import activation_offload
from verl_ds.roles.quant import quantize_int8


def enable_grad_checkpointing(model: torch.nn.Module) -> None:
    """Activation checkpointing that takes effect in eval mode.

    transformers' `GradientCheckpointingLayer` recomputes only when `self.gradient_checkpointing and
    self.training`, and the roles run in eval mode (`from_pretrained`'s, dropout off: RL's losses and
    the rollout-vs-trainer gap assume the deterministic forward). So the checkpointed layers alone are
    flagged `training` (not their children: every dropout and `self.training` branch inside stays as
    eval has it): the numbers are eval mode's, the memory checkpointing's (one layer input per layer
    kept for the backward). Non-reentrant checkpointing: the reentrant one needs an input that
    requires grad, which a frozen embedding (LoRA) does not give."""
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.eval()
    layers = [m for m in model.modules() if _checkpointed(m)]
    if not layers:
        raise ValueError(f"{type(model).__name__}: gradient checkpointing enabled but no layer checkpoints")
    for m in layers:
        m.training = True  # this module only: `train()` would recurse into its dropouts


def _checkpointed(module: torch.nn.Module) -> bool:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return isinstance(module, GradientCheckpointingLayer) and bool(getattr(module, "gradient_checkpointing", False))


def checkpointed_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The layers of `model` that will recompute their activations in the backward."""
    return [m for m in model.modules() if _checkpointed(m) and m.training]


def checkpointed_layers(model: torch.nn.Module) -> int:
    """How many layers of `model` will recompute their activations in the backward (0: none)."""
    return len(checkpointed_modules(model))


def model_inputs(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict:
    """input_ids/attention_mask/position_ids for a left-padded prompt + right-padded response.

    Position ids count real tokens only, so a left-padded sequence sees the same positions vLLM
    gives the unpadded prompt."""
    pos = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": pos}


def trim_padding(batch: TrainBatch) -> tuple[dict, int]:
    """Padding removal for one micro-batch: `model_inputs` without the columns no row uses, and the
    response width kept. Rows are padded to the whole batch's longest prompt and response; a
    micro-batch of shorter ones needs fewer columns (GRPO groups share a prompt length). Exact: a
    dropped column is a masked key for every real token, and positions count real tokens only."""
    mask = batch.attention_mask
    p = mask.shape[1] - batch.response_width
    used = mask.bool().any(0).cpu()  # one device sync, then index arithmetic on the host
    start = int(used[:p].int().argmax()) if p and bool(used[:p].any()) else p  # first prompt column in use
    keep = int(used[p:].nonzero().max()) + 1 if bool(used[p:].any()) else 1  # last response column in use
    return model_inputs(batch.input_ids[:, start : p + keep], mask[:, start : p + keep]), keep


def pad_response(x: torch.Tensor | None, width: int) -> torch.Tensor | None:
    """`[B, r]` per-response-token outputs back to the batch's `[B, width]` (zeros: masked positions)."""
    return x if x is None or x.shape[1] == width else torch.nn.functional.pad(x, (0, width - x.shape[1]))


def _row_lengths(batch: TrainBatch, shared: bool) -> tuple[list[int], list[int], list[int]]:
    """Each row's real prompt and response tokens (a response counts 1 at least: the pass never runs
    empty) and the id of its prompt: with `shared` prefixes (`prefix.py`), rows of one prompt run it
    once (the packer's unit; deeper shared prefixes only save more), else each row has its own."""
    mask = batch.attention_mask
    p = mask.shape[1] - batch.response_width
    plen = mask[:, :p].sum(1).tolist()
    rlen = [max(1, n) for n in mask[:, p:].sum(1).tolist()]
    if not shared:
        return plen, rlen, list(range(len(plen)))
    _, pid = torch.unique(torch.cat([batch.input_ids[:, :p], mask[:, :p]], 1), dim=0, return_inverse=True)
    return plen, rlen, pid.tolist()


def _run_tokens(rows: list[int], plen: list[int], rlen: list[int], packed: bool = False) -> tuple[int, int]:
    """(real, run) tokens of a micro-batch of `rows` after `trim_padding`: each row runs the
    micro-batch's longest prompt and longest response; `packed` (`pack_rows`): each row its own tokens."""
    real = sum(plen[i] + rlen[i] for i in rows)
    if packed:
        return real, real
    return real, len(rows) * (max(plen[i] for i in rows) + max(rlen[i] for i in rows))


def token_counts(batch: TrainBatch, packed: bool = False) -> tuple[float, float]:
    """(real tokens, tokens its forward runs) of one unshared micro-batch (`_run_tokens`); their ratio
    is `perf/padding_efficiency`. A `pad_row` entry is all waste."""
    plen, rlen, _ = _row_lengths(batch, False)
    real, run = _run_tokens(list(range(len(plen))), plen, rlen, packed)
    return (0.0 if batch.pad_row else float(real)), float(run)


def _size(rows: list[int], plen: list[int], rlen: list[int], pid: list[int]) -> int:
    """Tokens a micro-batch of `rows` holds against a token budget, padded to its longest prompt and
    response; each distinct prompt once where rows share prompts (`_row_lengths`)."""
    wp, wr = max(plen[i] for i in rows), max(rlen[i] for i in rows)
    return len({pid[i] for i in rows}) * wp + len(rows) * wr


# One micro-batch's fixed cost in tokens (the forward/backward call, ZeRO-3's weight gathers, GEMMs on
# fewer rows): the packer cuts another micro-batch where that saves more padding than this.
MICRO_BATCH_COST = {"cpu": 128, "cuda": 2048}  # CPU measured (docs/BENCHMARKS.md); GPU not yet


def pack_by_tokens(
    batch: TrainBatch,
    budget: int,
    shared: bool = False,
    cost: float = 0,
    rows_per_micro: int = 0,
    packed: bool = False,
) -> list[torch.Tensor]:
    """Row indices of micro-batches under a token budget, counted after padding removal ((longest
    prompt + longest response) x rows fits `budget`, or one row; with `shared` prompts each once,
    `_size`). Two candidates, the one with less `_size` + `cost` per micro-batch wins: rows sorted by
    length, cut where that runs the least (`_cut`: similar lengths share a micro-batch, a long tail gets
    its own); and, given `rows_per_micro` when each fits the budget, the rows in order in micro-batches of that many (a
    GRPO batch's groups stay whole, so each prompt runs once: better when answers are short); with `shared`,
    also each prompt's rows together, by length within it, cut as the first.
    `packed` rows (`pack_rows`) run their own tokens only, in any order: the rows in order, each
    micro-batch filled up to the budget."""
    plen, rlen, pid = _row_lengths(batch, shared)
    n = len(plen)
    if packed:
        groups, size = [[]], 0
        for i in range(n):
            if groups[-1] and size + plen[i] + rlen[i] > budget:
                groups.append([])
                size = 0
            groups[-1].append(i)
            size += plen[i] + rlen[i]
        return [torch.tensor(g, dtype=torch.long) for g in groups if g]
    by_length = _cut(sorted(range(n), key=lambda i: (plen[i] + rlen[i], i)), plen, rlen, pid, budget, cost)
    candidates = [by_length]
    if shared:  # each prompt's rows together, by length within it: the cuts can keep a prompt once
        first = {}
        for i in range(n):
            first.setdefault(pid[i], i)
        by_prompt = sorted(range(n), key=lambda i: (first[pid[i]], plen[i] + rlen[i], i))
        candidates.append(_cut(by_prompt, plen, rlen, pid, budget, cost))
    if rows_per_micro:
        in_order = [list(range(s, min(s + rows_per_micro, n))) for s in range(0, n, rows_per_micro)]
        if all(_size(g, plen, rlen, pid) <= budget for g in in_order):
            candidates.insert(0, in_order)  # the first on a tie
    best = min(candidates, key=lambda groups: sum(_size(g, plen, rlen, pid) + cost for g in groups))
    return [torch.tensor(g, dtype=torch.long) for g in best]


def _cut(order: list[int], plen: list[int], rlen: list[int], pid: list[int], budget: int, cost: float):
    """`order` cut into consecutive micro-batches that fit `budget`, at the cuts minimising `_size` +
    `cost` each (dynamic programming over the cut points: O(rows x rows per micro-batch))."""
    n = len(order)
    best, prev = [0.0] + [None] * n, [0] * (n + 1)
    for j in range(1, n + 1):  # best[j]: the cheapest cut of order[:j]
        wp = wr = 0
        prompts: set[int] = set()
        for i in range(j - 1, -1, -1):  # the last micro-batch is order[i:j]
            k = order[i]
            wp, wr = max(wp, plen[k]), max(rlen[k], wr)
            prompts.add(pid[k])
            size = len(prompts) * wp + (j - i) * wr  # `_size`
            if j - i > 1 and size > budget:
                break  # a longer one only grows
            total = best[i] + size + cost
            if best[j] is None or total < best[j]:
                best[j], prev[j] = total, i
    groups, j = [], n
    while j:
        groups.append(order[prev[j] : j])
        j = prev[j]
    return groups[::-1]


def in_row_order(rows: list[torch.Tensor], parts: list[torch.Tensor]) -> torch.Tensor:
    """Per-micro-batch outputs `parts` (of rows `rows`, together every row once) as one tensor in
    row order."""
    return torch.cat(parts)[torch.cat(rows).argsort().to(parts[0].device)]


def split_even(batch: TrainBatch, parts: int) -> list[TrainBatch]:
    """`parts` micro-batches of near-equal size, in order (a part left empty gets a `pad_row`)."""
    return [batch.select(idx) for idx in torch.arange(len(batch)).tensor_split(parts)]


def summarize(sums: dict, n_micro: int, world: int, global_keys: tuple) -> dict:
    """Per-rank metrics of one mini-batch. Losses normalised by global counts sum to this rank's
    share of the mini-batch value, so x world makes the cross-rank mean the global value; the
    other metrics are per-micro-batch means."""
    return {k: v * world if k in global_keys else v / n_micro for k, v in sums.items()}


class AutocastWarning(UserWarning):
    pass


_AUTOCAST_WARNED = False


def warn_if_autocast(*_hook_args) -> None:
    """Forward pre-hook on every role's engine: warn once per process when a role runs inside a
    user-opened `torch.autocast`; the framework owns each role's precision (DeepSpeed's config)."""
    global _AUTOCAST_WARNED
    devices = ("cpu", "cuda") if on_gpu() else ("cpu",)
    if not _AUTOCAST_WARNED and any(torch.is_autocast_enabled(d) for d in devices):
        _AUTOCAST_WARNED = True
        warnings.warn(
            "a role's forward runs inside a user-opened torch.autocast: verl-ds sets each role's "
            "precision itself (precision.*_dtype); autocast overrides it and can break fp16 loss "
            "scaling or the logprob mismatch. Remove the autocast context.",
            AutocastWarning,
            stacklevel=2,
        )


class RoleObserver:
    """Hooks a diagnostic or a test attaches to a live role (`role.observers.append(o)`), instead of
    replacing its methods. Every hook is optional; each runs on the calling rank, in the call."""

    def on_score(self, role: Role, batch: TrainBatch, args: tuple, out) -> None:
        """After a scoring pass (`logprobs`, `values`, `score`): its batch, other arguments, result."""

    def on_accumulate(self, role: Role, batch: TrainBatch) -> None:
        """Before a mini-batch's forward/backward (trained roles)."""

    def on_step(self, role: Role) -> None:
        """Before the optimizer step, with the reduced gradients in place (`role.grad_partitions()`)."""


@dataclass
class Accumulated:
    """What `Role.accumulate` hands back: the mini-batch's metrics and, when kept, each row's
    per-row output in row order (`micro_loss`'s third value)."""

    metrics: dict[str, float]
    outputs: torch.Tensor | None = None


class Role:
    """A model role backed by a DeepSpeed engine. `trainable` roles get the config's optimizer
    (or the torch `optimizer` given).

    Past ~300 lines because every role shares one engine life: build, score, accumulate and step,
    sleep/wake (offload), and the gradient scaling ZeRO and sequence parallelism ask for. The
    per-token math lives in algos/, the SP plumbing in sequence_parallel.py, DeepSpeed's private
    corners in ds_internals.py."""

    def __init__(
        self,
        name: str,
        model: torch.nn.Module,
        ds_config: dict,
        trainable: bool,
        optimizer=None,
        int8_activation: str | None = None,
        sp=None,
    ):
        """`int8_activation`: a frozen role whose Linear weights become int8 (`quantize_int8`), the
        dtype of everything else; None: the role runs in `ds_config`'s dtype. `sp`: this process's
        `SequenceParallel` (registered before any role is built): every pass splits its rows over it."""
        init_distributed()
        import deepspeed

        self.name, self.ds_config, self.trainable = name, ds_config, trainable
        self.sp = sp
        self.dtype = ds_dtype(ds_config)
        self.int8 = int8_activation is not None
        if self.dtype == "fp16":
            dsi.enable_cpu_fp16()
        dsi.quiet_bf16_optimizer()
        if not trainable:
            model.requires_grad_(False)
            model.eval()
        if self.int8:
            assert not trainable, f"{name}: int8 weights are for frozen roles"
            model = model.to(TORCH_DTYPES[int8_activation])  # the engine places the smaller copy
        # a user's torch optimizer replaces the config's optimizer block
        params = [p for p in model.parameters() if p.requires_grad] if trainable and optimizer is None else None
        self.engine, *_ = deepspeed.initialize(
            model=model, model_parameters=params, optimizer=optimizer, config=ds_config, mpu=sp and sp.mpu
        )
        if self.int8:  # after the engine's broadcast of plain weights, which an int8 tensor cannot take
            quantize_int8(self.engine.module, name)
        self.engine.register_forward_pre_hook(warn_if_autocast)
        self.micro_batch_size = int(ds_config["train_micro_batch_size_per_gpu"])
        self.aligned_skips = 0  # steps skipped because the partner role overflowed
        self.observers: list[RoleObserver] = []
        self._last_underflow = float("nan")
        self._tokens: dict[str, tuple[float, float, float]] = {}  # per pass: `take_token_counts`
        # fp32 ZeRO-0 runs a plain torch optimizer: DeepSpeed keeps no gradient norm for it (`step`
        # measures one), and on CPU its gradients are averaged over the ranks by a reusable-buffer
        # all-reduce at the accumulation boundary instead of DeepSpeed's (BucketAllReduce)
        self._plain = isinstance(self.engine.optimizer, torch.optim.Optimizer)
        self._plain_grad_norm = None
        self._reducer = None
        if trainable and self._plain and self.device.type == "cpu":
            dsi.set_backward_allreduce(self.engine, False)
            self._reducer = BucketAllReduce()

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    @property
    def device(self) -> torch.device:
        return self.engine.device

    max_tokens = 0  # roles.<role>.max_tokens_per_micro_batch resolved; 0: micro_batch_size rows each
    # rows that share a prefix run it once (`prefix.py`): the builder's choice (model.share_prompt, an
    # attention that takes the prefix mask); a micro-batch shares when it saves `share_min_tokens` and pays
    share_prefixes = False
    share_min_tokens = 0
    attention = "sdpa"  # the attention implementation the role's model was loaded with (the builder's)
    packing = False  # policy roles: padding-free rows (`pack_rows`), `RunSetup.packing`
    PASSES = ("score", "update")
    _FIRST_RESPONSE = True  # per-token roles score a row's first response column even when it is empty

    def take_token_counts(self) -> dict[str, tuple[float, float, float]]:
        """(held, distinct, run) tokens of each pass since the last call, then zero: the tokens the rows
        hold (a shared prefix once per row), those counted once per shared prefix, those the forwards
        ran (padding included). distinct / run is `perf/padding_efficiency`, distinct / held
        `perf/shared_tokens`."""
        counts, self._tokens = self._tokens, {}
        return {k: counts.get(k, (0.0, 0.0, 0.0)) for k in self.PASSES}

    def _count_tokens(self, kind: str, mb: TrainBatch) -> None:
        pack = self.prefix_pack(mb)
        if pack is not None:
            held, distinct, run = float(pack.held), float(len(pack)), float(len(pack))
        else:
            held, run = token_counts(mb, self.packing)
            distinct = held
        if mb.pad_row:
            held = distinct = 0.0
        old = self._tokens.get(kind, (0.0, 0.0, 0.0))
        self._tokens[kind] = (old[0] + held, old[1] + distinct, old[2] + run)

    _last_pack: tuple = (None, None)

    def prefix_pack(self, mb: TrainBatch) -> prefix.PrefixPack | None:
        """`mb`'s rows as one shared-prefix sequence where sharing is on and pays for it (`prefix.pays`),
        else None (the plain pass). Asked by the token count and by the forward of the same micro-batch:
        the last answer is kept."""
        if self._last_pack[0] is mb:
            return self._last_pack[1]
        pack = None
        if self.share_prefixes and not mb.pad_row and len(mb) > 1:
            take = prefix.held_columns(mb.attention_mask, mb.response_width, self._FIRST_RESPONSE)
            rows = prefix.sort_rows(mb.input_ids, take)  # prices the shared pass before laying it out
            # the packer counted each prompt once against the token budget: past it, share whatever it costs
            over = self.max_tokens and prefix.run_tokens(take)[0] > self.max_tokens
            # under SP a micro-batch of rows is one forward (as many on every rank): its pack, whatever it costs
            per_row = prefix.runs_per_row(self.attention, self._dtype)  # its attention may run per row
            if self.sp or over or prefix.pays(rows, take, self._hidden_size, self.share_min_tokens, per_row):
                pack = prefix.pack(mb.input_ids, take, rows)
        self._last_pack = (mb, pack)
        return pack

    @property
    def _hidden_size(self) -> int:
        config = getattr(self.module, "config", None) or self.module.backbone.config
        return int(config.hidden_size)

    @property
    def _dtype(self) -> torch.dtype:
        return next(p for p in self.module.parameters() if p.is_floating_point()).dtype

    def prefix_mask(self, pack: prefix.PrefixPack):
        """The 4D attention mask of `pack` as this role's attention implementation (`attention`) takes it."""
        return prefix.attention_mask(pack, self.attention, self._dtype)

    def packed(self, batch: TrainBatch) -> list[torch.Tensor]:
        """Under a token budget: `pack_by_tokens`, as many micro-batches on every rank (ZeRO-3 gathers
        in every forward, ZeRO-2/3 reduce in every backward; the ranks' lengths differ): a rank with
        fewer gets empty entries, run as one masked-out row."""
        cost = MICRO_BATCH_COST.get(self.device.type, MICRO_BATCH_COST["cuda"])
        groups = pack_by_tokens(
            batch, self.max_tokens, self.share_prefixes, cost, self.micro_batch_size, packed=self.packing
        )
        k = int(all_reduce_max(float(len(groups))))
        return groups + [torch.zeros(0, dtype=torch.long)] * (k - len(groups))

    _alone = False

    @contextlib.contextmanager
    def rows_alone(self):
        """Scoring passes run one row at a time, padded, unshared and without a token budget: the
        composition every other is compared with (`trainer_corr/`). Not counted in the step's tokens."""
        saved = (self.max_tokens, self.share_prefixes, self.packing)
        self.max_tokens, self.share_prefixes, self.packing, self._alone = 0, False, False, True
        try:
            yield
        finally:
            (self.max_tokens, self.share_prefixes, self.packing), self._alone = saved, False

    def micro_indices(self, batch: TrainBatch) -> list[torch.Tensor]:
        """Row indices of a scoring pass's micro-batches: consecutive `micro_batch_size` rows, or
        `packed` under a token budget, or (`rows_alone`) one row each."""
        if self._alone:  # as many forwards on every rank (ZeRO-3 gathers in each): empty entries pad
            k = int(all_reduce_max(float(len(batch))))
            return list(torch.arange(len(batch)).split(1)) + [torch.zeros(0, dtype=torch.long)] * (k - len(batch))
        if self.max_tokens:
            return self.packed(batch)
        return list(torch.arange(len(batch)).split(self.micro_batch_size))

    def map_micro(self, batch: TrainBatch, fn):
        """`fn(micro_batch)` over `micro_indices`; each output (a tensor, or a tuple of tensors / None)
        is put back in row order."""
        batch = batch.to(self.device)
        outs, rows, single = [], [], False
        for idx in self.micro_indices(batch):
            mb = batch.select(idx)
            if not self._alone:
                self._count_tokens("score", mb)
            out = fn(mb)  # an empty entry runs one dropped row
            single = not isinstance(out, tuple)
            if len(idx):
                outs.append((out,) if single else out)
                rows.append(idx)
        merged = tuple(None if parts[0] is None else in_row_order(rows, parts) for parts in zip(*outs))
        return merged[0] if single else merged

    # ------------------------------------------------------------ training (trainable roles)
    global_metric_keys: tuple = ()  # metrics normalised by global counts (see `summarize`)

    def micro_loss(self, mb: TrainBatch, counts: dict) -> tuple[torch.Tensor, dict, torch.Tensor | None]:
        """(loss, metrics, per-row output) of one micro-batch; `counts` = global_tokens/global_seqs
        for agg_loss. The per-row output (`[b, R]`, detached; the actor: its logprobs) is what
        `accumulate(..., keep=True)` hands back; None where a role has nothing to keep."""
        raise NotImplementedError

    def accumulate(
        self, batch: TrainBatch, global_tokens: float, global_seqs: float, keep: bool = False
    ) -> Accumulated:
        """Forward/backward over one mini-batch (this rank's share), leaving the optimizer step to
        `step()`. Losses use global counts, so the accumulated gradient equals the full mini-batch's.
        `keep`: also return each row's per-row output (in row order), e.g. the actor's logprobs of an
        on-policy batch, which are the old logprobs of its later epochs."""
        self.notify("on_accumulate", batch)
        gas = self.engine.gradient_accumulation_steps()
        scale = gas * self._grad_divisor()  # undo DeepSpeed's 1/gas and rank averaging
        batch = batch.to(self.device)
        # `gas` micro-steps: of micro_batch_size rows, or fewer when dynamic sampling shrank the batch.
        # Under a token budget, rows packed by length (`packed`), with the accumulation boundary set
        # by hand (`backward`). Each micro-batch carries its row positions (`rows`).
        mbs = [batch.select(idx) for idx in self.packed(batch)] if self.max_tokens else split_even(batch, gas)
        counts = dict(global_tokens=global_tokens, global_seqs=global_seqs)
        sums: dict[str, float] = {}
        rows, kept = [], []
        for i, mb in enumerate(mbs):
            self._count_tokens("update", mb)
            with self._offloading():
                loss, metrics, out = self.micro_loss(mb, counts)
                self.backward(loss * scale, boundary=i == len(mbs) - 1)
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v.detach() if torch.is_tensor(v) else v)
            if keep and out is not None and not mb.pad_row:
                rows.append(mb.rows)
                kept.append(out)
        metrics = summarize(sums, len(mbs), self.dp_size, self.global_metric_keys)
        return Accumulated(metrics, in_row_order(rows, kept) if kept else None)  # packed: out of order

    offload_activations = False  # trained roles: `roles.<role>.offload_activations` (the builder's, GPU)
    _offload = None  # the last micro-batch's offload (DeepSpeed's counts: `activation_offload_stats`)

    @property
    def activation_offload_stats(self):
        """DeepSpeed's counts of the last micro-batch's offloaded checkpoint inputs (None: none offloaded)."""
        return self._offload and self._offload.stats

    def _offloading(self):
        """Over one micro-batch's forward and backward: the checkpointed layers' inputs on the host
        (`long_rows.activation_offload`), or nothing."""
        if not self.offload_activations:
            return contextlib.nullcontext()
        self._offload = activation_offload(self.device.type == "cuda")
        return self._offload

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: the world, over the sequence-parallel size (a group's ranks hold the same rows)."""
        return self.engine.world_size // (self.sp.size if self.sp else 1)

    def _grad_divisor(self) -> float:
        """What the summed gradients of the ranks get divided by: the world by our own all-reduce
        (`BucketAllReduce`), else DeepSpeed's divisor for this stage (`gradient_divisor`)."""
        return self.engine.world_size if self._reducer else dsi.gradient_divisor(self.engine)

    def backward(self, loss: torch.Tensor, boundary: bool) -> None:
        """Backward through the engine; `engine.step()` for all but the boundary micro-batch, whose
        step is left to `step()` so that overflow can be aligned with another role first."""
        if self.max_tokens:
            self.engine.set_gradient_accumulation_boundary(boundary)
        self.engine.backward(loss)
        if not boundary:
            self.engine.step()
        elif self._reducer:
            self._reducer(self._trainable_grads())

    def notify(self, hook: str, *args) -> None:
        for o in self.observers:
            getattr(o, hook)(self, *args)

    def step(self) -> None:
        self.notify("on_step")
        if self.dtype == "fp16":
            self._last_underflow = self._underflow_fraction()
        # DeepSpeed clips a plain fp32 ZeRO-0 optimizer's gradients but keeps no norm: measure it here
        grads = self.grad_partitions() if self._plain else []
        self._plain_grad_norm = float(torch.nn.utils.get_total_norm(grads)) if grads else None  # foreach norms
        self.engine.step()

    # ------------------------------------------------------------ asleep while another uses the device
    asleep = False
    _reload = None  # what brings the states back (`ds_internals.offload_states`)

    def sleep(self, force: bool = False) -> bool:
        """Move this trained role's states (optimizer states, masters, gradients, weights) to host
        memory, so generation gets the device; `wake` brings them back, bitwise. Only where the role
        runs on a GPU: a CPU has no device memory to free, unless `force` (tests: a host-to-host move
        through the same DeepSpeed calls and checks). Needs a ZeRO optimizer (stage >= 1; the config
        refuses `sleep` at stage 0). Returns whether anything moved."""
        if self.asleep or not (force or self.device.type == "cuda"):
            return False
        self._reload = dsi.offload_states(self.engine)
        self.asleep = True
        return True

    def wake(self) -> None:
        if self.asleep:
            self._reload()
            self._reload, self.asleep = None, False

    def has_overflow(self) -> bool:
        """Whether the reduced gradients of the pending (boundary) step hold inf/NaN."""
        if self.dtype != "fp16":
            return False
        bad = float(any(not torch.isfinite(g).all() for g in self.grad_partitions()))
        return all_reduce_sum([bad])[0] > 0  # every rank must decide alike

    def force_skip(self) -> None:
        """Make DeepSpeed skip the pending step through its own overflow path (aligned overflow)."""
        for g in self.grad_partitions():
            g.view(-1)[:1].fill_(float("inf"))
            break
        self.aligned_skips += 1

    def _trainable_grads(self) -> list[torch.Tensor]:
        """Every trainable parameter's gradient; a missing one (unused on this rank) becomes zeros so
        that every rank reduces the same tensors, as DeepSpeed does."""
        for p in self.module.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        return [p.grad for p in self.module.parameters() if p.requires_grad]

    def grad_partitions(self) -> list[torch.Tensor]:
        """This rank's reduced gradients as the optimizer will step them, in a few large tensors
        (`ds_internals.grad_partitions`); writes reach the step."""
        return dsi.grad_partitions(self.engine)

    def master_params(self) -> list[torch.Tensor]:
        """The tensors the optimizer updates (fp32 masters for 16-bit roles), at any stage."""
        return dsi.master_params(self.engine)

    def _underflow_fraction(self, sample: int = 1 << 20) -> float:
        """fp16: fraction of (sampled) gradient elements that are exactly zero, i.e. underflowed."""
        zeros = total = 0
        for g in self.grad_partitions():
            flat = g.reshape(-1)[: sample - total]
            zeros += int((flat == 0).sum())
            total += flat.numel()
            if total >= sample:
                break
        return zeros / total if total else float("nan")

    # ------------------------------------------------------------ diagnostics
    def precision_stats(self) -> dict:
        """Dtypes (strings) and loss-scale/overflow/skip/grad-norm numbers for this role."""
        param = next(self.module.parameters())
        stats = {"param_dtype": "int8" if self.int8 else str(param.dtype).replace("torch.", "")}
        if not self.trainable:
            return stats
        opt = self.engine.optimizer
        master = self.master_params()[0]
        norm = self.engine.get_global_grad_norm()
        norm = self._plain_grad_norm if norm is None else norm
        norm = float(norm) if norm is not None else float("nan")
        stats.update(
            {
                "master_dtype": str(master.dtype).replace("torch.", ""),
                "grad_dtype": str(self.engine.get_data_types()[1]).replace("torch.", ""),
                "loss_scale": dsi.loss_scale(opt) if self.dtype == "fp16" else 1.0,
                "overflow": float(dsi.overflowed(opt)),
                "skipped_steps": float(self.engine.skipped_steps),
                "aligned_skips": float(self.aligned_skips),
                "grad_norm": norm if math.isfinite(norm) else float("nan"),
            }
        )
        if self.dtype == "fp16":
            stats["grad_underflow_frac"] = self._last_underflow
        return stats

    # ------------------------------------------------------------ checkpoints
    @property
    def has_frozen_params(self) -> bool:  # a LoRA actor: only the adapters are checkpointed
        return any(not p.requires_grad for p in self.module.parameters())

    def save(self, ckpt_dir: str, tag: str) -> None:
        self.engine.save_checkpoint(ckpt_dir, tag=tag, exclude_frozen_parameters=self.has_frozen_params)

    def load(self, ckpt_dir: str, tag: str) -> None:
        load_opt = self.trainable
        path, _ = self.engine.load_checkpoint(
            ckpt_dir,
            tag=tag,
            load_optimizer_states=load_opt,
            load_lr_scheduler_states=load_opt,
            load_module_strict=not self.has_frozen_params,
        )
        if path is None:
            raise FileNotFoundError(f"no {self.name} checkpoint '{tag}' in {ckpt_dir}")


def align_overflow(*roles: Role) -> bool:
    """Before the boundary step: if any fp16 role overflowed, every role skips this step
    (DeepSpeed-Chat's align_overflow). Returns whether the step is skipped."""
    flags = [r.has_overflow() for r in roles]
    if any(flags):
        for r, f in zip(roles, flags):
            if not f:
                r.force_skip()
        return True
    return False
