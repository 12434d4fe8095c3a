"""Sequence parallelism for every model role's passes, through DeepSpeed's own ALST code (Ulysses SP for
Hugging Face models, `deepspeed.runtime.sequence_parallel.ulysses_sp`): each row's tokens are split along
the sequence over the ranks of a sequence-parallel group, and every attention layer all-to-alls its
sequence shards into head shards and back (`UlyssesSPAttentionHF`, registered in place of the model's
attention implementation). This module owns the SP group and the sharding; the roles stay unaware of it.

What holds the result exact:
- a row runs alone, its real tokens from position 0 and padding only at its end (to a multiple of the SP
  size): DeepSpeed's wrapper drops the attention mask, and causal attention without one is the masked
  attention of such a row (a trailing pad attends only to what comes before it; nothing real attends to
  it). Rows packed into one sequence would attend across each other without varlen flash-attention;
- each shard predicts the next token at every position, its last position's label being the next shard's
  first token (a shard-local `logits[:, :-1]` would drop one token at every boundary);
- position ids are the row's own (DeepSpeed all-gathers them for the causal mask).

Gradients: every rank of the group computes the same loss from the same gathered per-token values, so
the gradient each holds for its own slice of them is already the whole gradient of that slice
(`_GatherShards` keeps it; `torch.distributed.nn`'s all-gather would sum it over the group: SP times too
large). The ranks' parameter gradients then sum to the row's gradient; what DeepSpeed divides that sum by
depends on the ZeRO stage under SP (`ds_internals.gradient_divisor`), and `Role.accumulate` scales the loss
by it.

A micro-batch is one sequence (DeepSpeed's registration fixes the batch dimension): one row, or, where
rows share prefixes (`roles/prefix.py`), their whole trie as one pack. The pack is split like a row; after
the all-to-all each rank holds the whole sequence for its heads, so the core attention takes the pack's
rule (`k <= q < end[k]`) over it (`_pack_aware`: DeepSpeed's wrapper drops HF's mask, which is the
shard's). The rule stays set until the next forward sets another, so a gradient-checkpointed layer
recomputed in the backward attends as it did forward. Every micro-batch runs one forward per row or one
per pack, as many on every rank (ZeRO-3's per-forward weight gathers stay matched).
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from verl_ds import algos
from verl_ds.roles import prefix
from verl_ds.roles.batch import TrainBatch

# the rule (`[1, 1, N, N]` bool) of the pack the next attention calls run over, made once a forward
# (None: one row, causal): `_pack_aware`
_PACK_RULE: contextvars.ContextVar = contextvars.ContextVar("verl_ds_sp_pack_rule", default=None)


def _pack_aware(core):
    """`core` (an HF attention function) taking the current pack's rule over the gathered sequence."""

    def attend(module, query, key, value, attention_mask, *args, **kwargs):
        rule = _PACK_RULE.get()
        return core(module, query, key, value, attention_mask if rule is None else rule, *args, **kwargs)

    return attend


class _SumShards(torch.autograd.Function):
    """The group's sum of `[K]` values each rank filled in part (zeros elsewhere), whose backward hands
    each rank the incoming gradient as it is: every rank computes the same loss from the same sums, so
    it already is the whole gradient of the entries a rank filled (`_GatherShards`' reasoning)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group) -> torch.Tensor:
        out = local.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _GatherShards(torch.autograd.Function):
    """All-gather of `[c]` shards into `[c * size]` whose backward hands each rank its own slice of the
    incoming gradient, unsummed (see the module's docstring)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group, rank: int, size: int) -> torch.Tensor:
        ctx.lo, ctx.hi = rank * len(local), (rank + 1) * len(local)
        parts = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[ctx.lo : ctx.hi], None, None, None


class PackShard(NamedTuple):
    """This rank's part of a shared-prefix pack (`SequenceParallel.shard_pack`)."""

    ids: torch.Tensor  # [1, c] this rank's tokens of the padded pack
    pos: torch.Tensor  # [1, c] their positions
    at: torch.Tensor  # [k] the wanted places this shard holds, as its local positions
    mine: torch.Tensor  # [K] bool: which of the wanted places those are


@dataclass(frozen=True)
class SequenceParallel:
    """This process's SP group: `size` ranks, this one `rank` among them; `mpu` is DeepSpeed's
    `parallel_state_sp`, which every role's `deepspeed.initialize` takes."""

    group: dist.ProcessGroup
    size: int
    rank: int
    mpu: object = None

    @classmethod
    def register(cls, model, size: int, attn_implementation: str = "sdpa") -> SequenceParallel:
        """DeepSpeed's registration for `model` (its attention implementation must be `attn_implementation`):
        the SP groups of the world, and the wrapper in place of that attention for every model of this
        process. Once per process: DeepSpeed's SP group is process-global, so every role shares it.
        -> this rank's group (its `mpu` is DeepSpeed's `parallel_state_sp`)."""
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        # DeepSpeed wraps the core it finds registered: the pack-aware one (`_pack_aware`)
        ALL_ATTENTION_FUNCTIONS[attn_implementation] = _pack_aware(ALL_ATTENTION_FUNCTIONS[attn_implementation])
        mpu = UlyssesSPAttentionHF.register_with_transformers(
            model, attn_implementation, size, micro_batch_size=1, seq_length_is_variable=True
        )
        group = mpu.get_sequence_parallel_group()
        return cls(group, dist.get_world_size(group), dist.get_rank(group), mpu)

    def shard(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One row's real tokens `[n]` -> this rank's (ids `[1, c]`, position ids `[1, c]`, labels `[c]`):
        the row padded at its end to `c * size` tokens, positions counted from 0, each position's label the
        token after it (the next shard's first at this shard's end; a pad past the row's last token)."""
        n = len(ids)
        c = -(-n // self.size)
        full = torch.nn.functional.pad(ids, (0, c * self.size + 1 - n))  # one more: the last position's label
        lo, hi = self.rank * c, (self.rank + 1) * c
        pos = torch.arange(lo, hi, device=ids.device)[None]
        return full[None, lo:hi], pos, full[lo + 1 : hi + 1]

    def same(self, t: torch.Tensor) -> torch.Tensor:
        """`t` as the group's first rank holds it, on every rank of the group (a shuffle of the rows they
        share, drawn from per-rank random states)."""
        dist.broadcast(t, src=dist.get_global_rank(self.group, 0), group=self.group)
        return t

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """Every shard's `[c]` values, in sequence order: `[c * size]` on every rank of the group
        (differentiable: `_GatherShards`)."""
        return _GatherShards.apply(local, self.group, self.rank, self.size)

    def per_token(self, batch: TrainBatch, shard_fn) -> tuple[torch.Tensor | None, ...]:
        """`[B, R]` per-response-token outputs, each row split over the group. `shard_fn(ids [1, c],
        positions [1, c], labels [c], (a, b))` -> a tuple of `[c]` values (or None), the value at local
        position j being about the token after it (`labels[j]`); only positions a..b-1 predict response
        tokens, and the others may be left 0. Collective: every rank of the group passes the same batch."""
        width = batch.response_width
        prompt_cols = batch.attention_mask.shape[1] - width
        rows = []
        for i in range(len(batch)):
            real = batch.attention_mask[i].bool()
            ids = batch.input_ids[i][real]
            p = max(1, int(real[:prompt_cols].sum()))  # the row's real prompt tokens
            r = int(real[prompt_cols:].sum())  # and response tokens (right-padded)
            local_ids, pos, labels = self.shard(ids if len(ids) else batch.input_ids[i][:1])
            c, lo = local_ids.shape[1], self.rank * local_ids.shape[1]
            _PACK_RULE.set(None)  # a row alone: causal
            # response token j sits at p + j and is predicted at p + j - 1
            window = (min(max(p - 1 - lo, 0), c), min(max(p - 1 + r - lo, 0), c))
            outs = shard_fn(local_ids, pos, labels, window)
            rows.append(
                tuple(
                    None if v is None else torch.nn.functional.pad(self.gather(v)[p - 1 : p - 1 + r], (0, width - r))
                    for v in outs
                )
            )
        return tuple(None if parts[0] is None else torch.stack(parts) for parts in zip(*rows))

    def shard_pack(self, pack: prefix.PrefixPack, places: torch.Tensor) -> PackShard:
        """A shared-prefix pack's `[N]` tokens -> this rank's shard of it, the pack padded at its end to
        `c * size` places (a pad sees itself only), with which of `places` (`[K]`, duplicates allowed) it
        holds; the pack's rule set for the attention calls that follow (`_PACK_RULE`)."""
        n = len(pack)
        c = -(-n // self.size)
        extra = c * self.size - n
        dev = pack.input_ids.device
        _PACK_RULE.set(prefix.allowed(torch.cat([pack.end, torch.arange(n, n + extra, device=dev) + 1]))[None, None])
        ids = torch.nn.functional.pad(pack.input_ids, (0, extra))
        pos = torch.cat([pack.position_ids, torch.zeros(extra, dtype=torch.long, device=dev)])
        lo = self.rank * c
        mine = (places >= lo) & (places < lo + c)
        return PackShard(ids[None, lo : lo + c], pos[None, lo : lo + c], places[mine] - lo, mine)

    def to_rows(self, shard: PackShard, local: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
        """This rank's `[k]` values at its `shard.at` -> the group's `[B, R]` (0 where `where` is not):
        each place's value from the rank holding it, summed over the group (`_SumShards`)."""
        full = local.new_zeros(len(shard.mine)).index_put((shard.mine.nonzero()[:, 0],), local)
        return local.new_zeros(where.shape).masked_scatter(where, _SumShards.apply(full, self.group))

    def policy_forward(
        self,
        model,
        batch: TrainBatch,
        token_dist: algos.TokenDist,
        with_entropy: bool,
        entropy_grad: bool,
        pack: prefix.PrefixPack | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`PolicyRole.forward` split: (logprobs `[B, R]`, entropy `[B, R]` or None). Logits only for the
        shard's positions that predict response tokens (`logits_to_keep`), as the unsplit pass keeps.
        `pack`: the micro-batch's rows as one shared-prefix sequence, split as one row."""
        if pack is not None:
            keep, where = pack.response(batch.response_width)
            labels = batch.input_ids[:, -batch.response_width :][where]
            shard = self.shard_pack(pack, keep)
            logits = model(input_ids=shard.ids, position_ids=shard.pos, use_cache=False, logits_to_keep=shard.at).logits
            lp, entropy = algos.token_logprobs(logits, labels[shard.mine][None], token_dist, with_entropy, entropy_grad)
            return tuple(None if x is None else self.to_rows(shard, x[0].float(), where) for x in (lp, entropy))

        def shard_fn(ids, pos, labels, window):
            a, b = window
            keep = torch.arange(a, b, device=ids.device)
            logits = model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=keep).logits
            lp, entropy = algos.token_logprobs(logits, labels[a:b][None], token_dist, with_entropy, entropy_grad)
            c = ids.shape[1]
            spread = lambda x: None if x is None else torch.nn.functional.pad(x[0].float(), (a, c - b))  # noqa: E731
            return spread(lp), spread(entropy)

        return self.per_token(batch, shard_fn)

    def values(self, model, batch: TrainBatch, pack: prefix.PrefixPack | None = None) -> torch.Tensor:
        """The critic's `[B, R]` values V(state before each response token), split (`pack`: as one row)."""
        if pack is not None:
            keep, where = pack.response(batch.response_width)
            shard = self.shard_pack(pack, keep)
            local = model(input_ids=shard.ids, attention_mask=None, position_ids=shard.pos)[0].float()
            return self.to_rows(shard, local[shard.at], where)

        def shard_fn(ids, pos, labels, window):
            return (model(input_ids=ids, attention_mask=None, position_ids=pos)[0].float(),)

        return self.per_token(batch, shard_fn)[0]

    @torch.no_grad()
    def scores(self, model, batch: TrainBatch, pad: int) -> torch.Tensor:
        """A reward model's `[B]` fp32 scores of this rank's own rows. Rewards are scored where the rows were
        generated, before a group joins them, so each rank of the group passes its own rows (their counts
        may differ): the group scores every rank's rows in turn, each row split over all of it, and each
        rank keeps its own. A row's score is its head's at the position where HF's sequence classifier
        pools (the row's last token that is not the model's `pad` id), read from the gathered per-position
        head outputs. Collective over the group."""
        backbone = getattr(model, model.base_model_prefix)
        dev = batch.input_ids.device
        mine = [batch.input_ids[i][batch.attention_mask[i].bool()] for i in range(len(batch))]
        mine = [ids if len(ids) else batch.input_ids[i][:1] for i, ids in enumerate(mine)]
        counts = [torch.zeros(1, dtype=torch.long, device=dev) for _ in range(self.size)]
        dist.all_gather(counts, torch.tensor([len(mine)], device=dev), group=self.group)
        out = []
        for src, count in enumerate(counts):
            root = dist.get_global_rank(self.group, src)
            for j in range(int(count)):
                n = torch.tensor([len(mine[j]) if src == self.rank else 0], device=dev)
                dist.broadcast(n, src=root, group=self.group)
                ids = mine[j] if src == self.rank else torch.empty(int(n), dtype=torch.long, device=dev)
                dist.broadcast(ids, src=root, group=self.group)
                local_ids, pos, _ = self.shard(ids)
                _PACK_RULE.set(None)
                hidden = backbone(input_ids=local_ids, position_ids=pos, use_cache=False).last_hidden_state
                score = self.gather(model.score(hidden)[0, :, 0].float())
                if src == self.rank:
                    out.append(score[int((torch.arange(len(ids), device=dev) * (ids != pad)).argmax())])
        return torch.stack(out) if out else torch.zeros(0, device=dev)

    @torch.no_grad()
    def logprobs(self, model, batch: TrainBatch, token_dist: algos.TokenDist = algos.FULL) -> torch.Tensor:
        """`[B, R]` fp32 log-probabilities of the response tokens, as `PolicyRole.logprobs` gives them
        (0 where the response is padding), each row split over the group."""
        return self.policy_forward(model, batch, token_dist, False, False)[0]
