"""Shared prefixes: the rows of a micro-batch that share a prefix run it once, in every role's pass.

A micro-batch's rows (each its real tokens: a left-padded prompt, then a right-padded response) go into a
trie, laid out as one sequence in depth-first order: each node's tokens once, each at its position in its
rows (the node's depth), and attention limited to the token's own path. In depth-first order a node's
subtree is contiguous, so one per-token array says who sees whom: token k is seen by the queries q with
`k <= q < end[k]`, `end[k]` being where k's node's subtree ends. Each row reads its outputs at its own
path's places; a shared node's gradient is the sum over every row that reads through it (the gather's
backward). Identical prompts are the one-level case; multi-turn episodes forked after their first turns,
and an agent's calls that continue one row, are deeper ones.

Why this route and not the prompt's KV cache: HF drops caches in gradient-checkpointed layers, while one
sequence under a mask is a plain forward (checkpointing, LoRA, ZeRO-3's per-forward gathers unchanged),
and the rule `k <= q < end[k]` is one array every attention kernel can take: a dense mask (SDPA, eager),
FlexAttention's `mask_mod` (a block mask: GPUs), and the core attention past DeepSpeed's Ulysses
all-to-all, which drops HF's masks: under sequence parallelism a pack is split like one row and the
rule is applied over the gathered sequence (`roles/sequence_parallel.py`, dense; FlexAttention there
takes DeepSpeed's causal block mask only, so SP with it does not share).

Exact up to summation order: every token sees exactly the tokens it sees in its own row, at the same
positions. Whether a micro-batch shares is a cost question (`pays`), decided per micro-batch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from verl_ds.roles.attention import NAME as SDPA_CPU16

log = logging.getLogger(__name__)

Tensor = torch.Tensor


@dataclass(frozen=True)
class PrefixPack:
    """One micro-batch's rows as a trie in one sequence (`pack`). `N` pack tokens, `B` rows, `T` columns."""

    input_ids: Tensor  # [N] the pack's tokens
    position_ids: Tensor  # [N] each token's position in its rows
    end: Tensor  # [N] long: token k is seen by queries k <= q < end[k]
    index: Tensor  # [B, T] long: each column's place in the pack (-1: a column the row does not hold)
    pred: Tensor  # [B, T] long: the place of the token before each column's (-1: none), which predicts it
    held: int  # tokens the rows hold, a shared prefix counted once per row
    paths: Tensor  # [U, L] long: each distinct row's places in order (-1 past its end): what its tokens attend
    owner: Tensor  # [N] long: the distinct row that lays each place out (the place sits at its position there)

    def __len__(self) -> int:
        return len(self.input_ids)

    def inputs(self, mask) -> dict:
        """A model's inputs for the pack: `[1, N]` ids and positions and `mask` (`attention_mask`)."""
        return {"input_ids": self.input_ids[None], "position_ids": self.position_ids[None], "attention_mask": mask}

    def response(self, response_width: int) -> tuple[Tensor, Tensor]:
        """(the pack places whose outputs predict the rows' held response columns `[K]`, where those
        columns sit in the response `[B, R]` bool). V(state before a token) sits at the same places."""
        pred = self.pred[:, self.pred.shape[1] - response_width :]
        where = self.index[:, self.index.shape[1] - response_width :] >= 0
        keep = pred[where]
        assert bool((keep >= 0).all()), "a response token without a token before it (an empty prompt)"
        return keep, where


def held_columns(attention_mask: Tensor, response_width: int, first_response: bool = True) -> Tensor:
    """`[B, T]` bool: the columns each row holds, its real tokens; with `first_response`, a row's first
    response column always (so an empty response still has a masked token to score: `policy.pack_rows`)."""
    take = attention_mask.bool().clone()
    if first_response and response_width:
        take[:, take.shape[1] - response_width] = True
    return take


@dataclass(frozen=True)
class SortedRows:
    """A micro-batch's distinct rows in lexicographic order (`sort_rows`): in that order a trie's
    depth-first layout is each row's tokens past its longest common prefix with the row before it."""

    tokens: Tensor  # [U, L] long: each distinct row's held tokens from position 0, -1 past its end
    inverse: Tensor  # [B] long: each row's distinct row
    lengths: Tensor  # [U] long
    common: Tensor  # [U] long: the common prefix with the row before (0 for the first)

    @property
    def distinct(self) -> int:
        """The trie's tokens: each shared prefix once."""
        return int((self.lengths - self.common).sum())


def sort_rows(input_ids: Tensor, take: Tensor) -> SortedRows:
    """The rows' held tokens (`take`, `held_columns`), left-aligned, distinct and sorted (a few tensor ops:
    enough to price the shared pass before laying it out)."""
    ids, take = input_ids.cpu(), take.cpu()
    width = int(take.sum(1).max()) if take.numel() else 0
    left = torch.full((len(ids), max(width, 1)), -1, dtype=torch.long)
    row, _ = take.nonzero(as_tuple=True)
    left[row, (take.long().cumsum(1) - 1)[take]] = ids[take]
    tokens, inverse = torch.unique(left, dim=0, return_inverse=True)  # sorted, -1 (ended) first
    lengths = (tokens >= 0).sum(1)
    common = torch.zeros(len(tokens), dtype=torch.long)
    if len(tokens) > 1:  # distinct rows differ somewhere: the first place they do
        common[1:] = (tokens[1:] != tokens[:-1]).long().argmax(1)
    return SortedRows(tokens, inverse, lengths, common)


def pack(input_ids: Tensor, take: Tensor, rows: SortedRows | None = None) -> PrefixPack:
    """The rows' held tokens as a trie in one sequence, in depth-first order, children by token id: the
    distinct rows in lexicographic order (`sort_rows`), each emitting its tokens past its common prefix
    with the row before. A token of row u at depth d heads a subtree that runs until the first later row
    whose common prefix with u (the running minimum of `common`) is d or shorter."""
    rows = rows or sort_rows(input_ids, take)
    lengths, common = rows.lengths.tolist(), rows.common.tolist()
    own = rows.lengths - rows.common
    starts = (own.cumsum(0) - own).tolist()
    n = rows.distinct
    ids, pos, end, places, owner = [], [], [], [], []
    for u, (length, c, start) in enumerate(zip(lengths, common, starts)):
        owner.append(torch.full((length - c,), u, dtype=torch.long))
        ids.append(rows.tokens[u, c:length])
        depth = torch.arange(c, length)
        pos.append(depth)
        later = torch.cummin(rows.common[u + 1 :], 0).values if u + 1 < len(lengths) else rows.common[:0]
        first = torch.searchsorted(-later, -depth)  # the first later row that leaves this token's subtree
        after = torch.tensor(starts[u + 1 :] + [n], dtype=torch.long)
        end.append(after[first])
        mine = torch.arange(start, start + length - c)
        places.append(torch.cat([places[u - 1][:c], mine]) if c else mine)
    dev = input_ids.device
    index = torch.full(take.shape, -1, dtype=torch.long)
    pred = torch.full(take.shape, -1, dtype=torch.long)
    take_h = take.cpu()
    for i, u in enumerate(rows.inverse.tolist()):
        cols = take_h[i].nonzero()[:, 0]
        index[i, cols] = places[u]
        pred[i, cols[1:]] = places[u][:-1]
    paths = torch.full((len(lengths), max(lengths, default=0)), -1, dtype=torch.long)
    for u, p in enumerate(places):
        paths[u, : len(p)] = p
    cat = lambda parts: torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)  # noqa: E731
    return PrefixPack(
        cat(ids).to(dev),
        cat(pos).to(dev),
        cat(end).to(dev),
        index.to(dev),
        pred.to(dev),
        int(take_h.sum()),
        paths.to(dev),
        cat(owner).to(dev),
    )


def run_tokens(take: Tensor) -> tuple[int, int]:
    """(tokens, attended pairs) of the plain pass over `take`'s rows after padding removal: every row
    padded to the micro-batch's longest prompt and response (`base.trim_padding`)."""
    cols = take.any(0).nonzero()
    width = int(cols.max() - cols.min() + 1) if len(cols) else 0
    return len(take) * width, len(take) * width * width


def pays(rows: SortedRows, take: Tensor, hidden_size: int, min_saved: int, per_row: bool = False) -> bool:
    """Whether the shared pass over `rows` is cheaper than the plain pass over `take`'s rows (`cheaper`);
    `per_row`: its attention may run per row (`by_path`: the `sdpa_cpu16` implementation)."""
    tokens, pairs = run_tokens(take)
    u, longest = len(rows.lengths), int(rows.lengths.max()) if len(rows.lengths) else 0
    per_row_pairs = u * longest * longest if per_row else None
    return cheaper(rows.distinct, tokens, pairs, len(take), hidden_size, min_saved, per_row_pairs)


def runs_per_row(implementation: str, dtype: torch.dtype) -> bool:
    """Whether a pack's attention may run per row (`by_path`): `sdpa_cpu16`'s 16-bit passes, where the pack's
    one masked attention rounds differently from the plain pass (a matched 16-bit pair would lose its
    exactness); in fp32 that attention agrees to rounding and costs less on small models (no gathers)."""
    return implementation == SDPA_CPU16 and dtype in (torch.bfloat16, torch.float16)


def by_path(pack_: PrefixPack) -> bool:
    """Whether the pack's attention runs per distinct row (`attention.by_path`: each row's path of places
    gathered into a padded row of its own, the plain pass's layout and kernel, so its outputs are the plain
    pass's bit for bit in any dtype) rather than over the whole pack under its `[N, N]` mask: where that
    is fewer attended pairs, `U x L^2 <= N^2` (short shared prefixes, as a prompt's n samples often are)."""
    u, longest = pack_.paths.shape
    return u * longest * longest <= len(pack_) ** 2


def min_saved_tokens(setting, actor_dtype: str) -> int:
    """`model.share_prefix_min_tokens` resolved: a number as given; `auto` by the actor's dtype (config.py's
    help says why: fp32 shares from 6 tokens a row, a 16-bit actor (or one not yet resolved) from 16)."""
    if setting != "auto":
        return int(setting)
    return 6 if actor_dtype == "fp32" else 16


def cheaper(
    shared: int, tokens: int, pairs: int, rows: int, hidden_size: int, min_saved: int, by_path_pairs: int | None = None
) -> bool:
    """Whether a shared pass of `shared` tokens beats a plain one of `rows` rows, `tokens` tokens and `pairs`
    attended pairs. It must save at least `min_saved` tokens a row: below that the trie, the mask and the
    gathers cost more than the tokens saved on a small model (`benchmarks/shared_prefix_threshold.py`); and
    it must cost fewer multiply-adds a layer: a token's projections and MLP ~ 6 x hidden x hidden (counted
    as 6 x hidden per unit of hidden), an attended pair ~ 1 x hidden (each masked pass's kernel visits
    every pair of its square: the pack's `N^2`, the padded rows' `B x W^2`; or per distinct row,
    `by_path_pairs` = `U x L^2`, where that is fewer: `by_path`)."""
    if tokens - shared < min_saved * rows:
        return False
    shared_pairs = min(shared * shared, by_path_pairs if by_path_pairs is not None else shared * shared)
    return shared * 6 * hidden_size + shared_pairs < tokens * 6 * hidden_size + pairs


# ---------------------------------------------------------------- masks


def allowed(end: Tensor) -> Tensor:
    """`[N, N]` bool: query q sees key k (`k <= q < end[k]`)."""
    k = torch.arange(len(end), device=end.device)
    return (k[None, :] <= k[:, None]) & (k[:, None] < end[None, :])


def attention_mask(pack_: PrefixPack, implementation: str, dtype: torch.dtype):
    """The 4D mask transformers passes through unchanged, as `implementation` takes it: FlexAttention's
    block mask from the same rule (GPU; `mask_mod` reads `end`), eager's additive `[1, 1, N, N]` in
    `dtype`, else SDPA's boolean `[1, 1, N, N]` (sdpa, sdpa_cpu16; SDPA's kernels take any mask)."""
    end = pack_.end
    if implementation == "flex_attention":
        from torch.nn.attention.flex_attention import create_block_mask

        def mask_mod(b, h, q, k):
            return (k <= q) & (q < end[k])

        n = len(end)
        return create_block_mask(mask_mod, 1, None, n, n, device=end.device)
    keep = allowed(end)[None, None]
    if implementation == "eager":
        return torch.zeros(keep.shape, dtype=dtype, device=end.device).masked_fill_(~keep, torch.finfo(dtype).min)
    if runs_per_row(implementation, dtype) and by_path(pack_):  # read by `attention.attention`: per row
        keep.prefix_pack = pack_  # transformers hands a 4D mask to the attention as it is, recomputes included
    return keep


SUPPORTED = ("sdpa", "sdpa_cpu16", "eager", "flex_attention")  # varlen flash-attention cannot express a prefix


def resolve_sharing(cfg, attention_: str, actor_dtype: str) -> tuple[bool, int]:
    """Whether the roles' passes share prefixes (`roles/prefix.py`), and from how many tokens saved a row
    (`prefix.min_saved_tokens`), said in one line: `model.share_prompt`, where the policy models' attention
    takes the prefix mask (varlen flash-attention cannot; under sequence parallelism the dense mask, which
    `roles/sequence_parallel.py` applies past DeepSpeed's all-to-all, not FlexAttention's block mask)."""
    m, sp = cfg.model, cfg.trainer.sequence_parallel_size
    why = (
        "model.share_prompt is false"
        if not m.share_prompt
        else f"{attention_} cannot take a prefix mask (use sdpa or flex_attention)"
        if attention_ not in SUPPORTED
        else f"trainer.sequence_parallel_size {sp}: {attention_} under SP takes a causal mask only (use sdpa)"
        if sp > 1 and attention_ == "flex_attention"
        else ""
    )
    min_saved = min_saved_tokens(m.share_prefix_min_tokens, actor_dtype)
    if why:
        log.info("shared prefixes: off (%s)", why)
        return False, min_saved
    log.info(
        "shared prefixes: on (a micro-batch's rows run each prefix they share once, in every role's passes, "
        "where that saves at least %d tokens a row%s and its cost model says it pays)",
        min_saved,
        f" ({actor_dtype} actor)" if m.share_prefix_min_tokens == "auto" else "",
    )
    return True, min_saved
