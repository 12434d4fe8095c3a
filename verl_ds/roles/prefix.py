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
FlexAttention's `mask_mod` (a block mask: GPUs), and, not yet written, the core attention past DeepSpeed's
Ulysses all-to-all, which drops masks (under sequence parallelism a row runs alone, unshared).

Exact up to summation order: every token sees exactly the tokens it sees in its own row, at the same
positions. Whether a micro-batch shares is a cost question (`pays`), decided per micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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


def pack(input_ids: Tensor, take: Tensor) -> PrefixPack:
    """The rows' held tokens (`take`, `held_columns`) as a trie in one sequence, in depth-first order,
    the children of a node in the order their first row comes."""
    dev = input_ids.device
    ids_h, take_h = input_ids.cpu(), take.cpu()
    seqs = [ids_h[i][take_h[i]] for i in range(len(ids_h))]
    ids: list[Tensor] = []
    pos: list[Tensor] = []
    end: list[int] = []  # per node: (start, length) filled once its subtree is laid out
    places = [torch.empty(len(s), dtype=torch.long) for s in seqs]
    size = 0

    def lay(rows: list[int], depth: int) -> None:
        nonlocal size
        first = seqs[rows[0]]
        n = min(len(seqs[r]) for r in rows) - depth  # the longest extension every row shares
        for r in rows[1:]:
            if n <= 0:
                break
            diff = (seqs[r][depth : depth + n] != first[depth : depth + n]).nonzero()
            n = int(diff[0]) if len(diff) else n
        n = max(n, 0)
        start = size
        if n:
            ids.append(first[depth : depth + n])
            pos.append(torch.arange(depth, depth + n))
            for r in rows:
                places[r][depth : depth + n] = torch.arange(start, start + n)
            size += n
            end.extend([0] * n)
        children: dict[int, list[int]] = {}
        for r in rows:
            if len(seqs[r]) > depth + n:
                children.setdefault(int(seqs[r][depth + n]), []).append(r)
        for group in children.values():
            lay(group, depth + n)
        end[start : start + n] = [size] * n

    lay(list(range(len(seqs))), 0)
    index = torch.full(take_h.shape, -1, dtype=torch.long)
    pred = torch.full(take_h.shape, -1, dtype=torch.long)
    for i, where in enumerate(places):
        cols = take_h[i].nonzero()[:, 0]
        index[i, cols] = where
        pred[i, cols[1:]] = where[:-1]
    cat = lambda parts: torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)  # noqa: E731
    return PrefixPack(
        cat(ids).to(dev),
        cat(pos).to(dev),
        torch.tensor(end, dtype=torch.long, device=dev),
        index.to(dev),
        pred.to(dev),
        sum(len(s) for s in seqs),
    )


def run_tokens(take: Tensor) -> tuple[int, int]:
    """(tokens, attended pairs) of the plain pass over `take`'s rows after padding removal: every row
    padded to the micro-batch's longest prompt and response (`base.trim_padding`)."""
    used = take.any(0)
    width = int(used.nonzero().max() - used.nonzero().min() + 1) if bool(used.any()) else 0
    return len(take) * width, len(take) * width * width


def pays(pack_: PrefixPack, take: Tensor, hidden_size: int, min_saved: int) -> bool:
    """Whether `pack_` is cheaper to run than the plain pass over `take`'s rows (`cheaper`)."""
    tokens, pairs = run_tokens(take)
    return cheaper(len(pack_), tokens, pairs, len(take), hidden_size, min_saved)


def cheaper(shared: int, tokens: int, pairs: int, rows: int, hidden_size: int, min_saved: int) -> bool:
    """Whether a shared pass of `shared` tokens beats a plain one of `rows` rows, `tokens` tokens and `pairs`
    attended pairs. It must save at least `min_saved` tokens a row: below that the trie, the mask and the
    gathers cost more than the tokens saved on a small model (`benchmarks/shared_prefix_threshold.py`); and
    it must cost fewer multiply-adds a layer: a token's projections and MLP ~ 6 x hidden x hidden (counted
    as 6 x hidden per unit of hidden), an attended pair ~ 1 x hidden (each masked pass's kernel visits
    every pair of its square: the pack's `N^2`, the padded rows' `B x W^2`)."""
    if tokens - shared < min_saved * rows:
        return False
    return shared * 6 * hidden_size + shared * shared < tokens * 6 * hidden_size + pairs


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
    return keep


SUPPORTED = ("sdpa", "sdpa_cpu16", "eager", "flex_attention")  # varlen flash-attention cannot express a prefix
