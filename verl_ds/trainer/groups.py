"""Dynamic sampling's bookkeeping (DAPO `filter_groups`): which groups carry a GRPO gradient, and
how kept groups from several generation rounds become one batch."""

from __future__ import annotations

import torch

from verl_ds.rollout import RolloutBatch


def varied_groups(metric: torch.Tensor, group_ids: torch.Tensor, n_groups: int) -> list[int]:
    """Groups whose samples did not all score alike (the only ones with a GRPO gradient)."""
    return [g for g in range(n_groups) if metric[group_ids == g].unique().numel() > 1]


def select_groups(batch, examples, raw, shaped, groups: list[int]):
    """The rows of `groups` (in that order), renumbered 0..len(groups)-1."""
    rows = (
        torch.cat([(batch.group_ids == g).nonzero().flatten() for g in groups])
        if groups
        else torch.zeros(0, dtype=torch.long)
    )
    out = batch.select(rows)
    remap = {g: i for i, g in enumerate(groups)}
    out.group_ids = torch.tensor([remap[int(g)] for g in out.group_ids], dtype=torch.long)
    return out, [examples[g] for g in groups], raw[rows], shaped[rows]


def merge_parts(parts):
    """Concatenate (batch, examples, raw, shaped) parts, offsetting group ids."""
    batches, offset = [], 0
    for b, ex, _, _ in parts:
        b.group_ids = b.group_ids + offset
        batches.append(b)
        offset += len(ex)
    batch = RolloutBatch.cat([b for b in batches if len(b)]) if any(len(b) for b in batches) else batches[0]
    return (batch, [e for p in parts for e in p[1]], torch.cat([p[2] for p in parts]), torch.cat([p[3] for p in parts]))
