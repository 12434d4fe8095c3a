"""What the collect phase hands the step (`Collected`), and dynamic sampling's bookkeeping (DAPO
`filter_groups`): which groups carry a GRPO gradient, and how kept groups from several generation
rounds become one batch."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from verl_ds.rollout import RolloutBatch


@dataclass(frozen=True)
class Collected:
    """One step's rollout on this rank, scored. `batch.group_ids` index `examples` (a prompt's rows
    form its group); `raw`: each row's score (reward function or model, plus the environment's);
    `shaped`: `raw` plus the overlong penalty, what the advantages start from. Both `[B]` fp32."""

    batch: RolloutBatch
    examples: list[dict]
    raw: torch.Tensor
    shaped: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)

    def select_groups(self, groups: list[int]) -> Collected:
        """The rows of `groups` (in that order), renumbered 0..len(groups)-1."""
        rows = (
            torch.cat([(self.batch.group_ids == g).nonzero().flatten() for g in groups])
            if groups
            else torch.zeros(0, dtype=torch.long)
        )
        out = self.batch.select(rows)
        remap = {g: i for i, g in enumerate(groups)}
        out.group_ids = torch.tensor([remap[int(g)] for g in out.group_ids], dtype=torch.long)
        return replace(
            self, batch=out, examples=[self.examples[g] for g in groups], raw=self.raw[rows], shaped=self.shaped[rows]
        )

    @staticmethod
    def merge(parts: list[Collected]) -> Collected:
        """One batch of `parts` (each's group ids offset past the previous parts'); their metrics dropped."""
        batches, offset = [], 0
        for p in parts:
            batches.append(replace(p.batch, group_ids=p.batch.group_ids + offset))
            offset += len(p.examples)
        real = [b for b in batches if len(b)]
        return Collected(
            RolloutBatch.cat(real) if real else batches[0],
            [e for p in parts for e in p.examples],
            torch.cat([p.raw for p in parts]),
            torch.cat([p.shaped for p in parts]),
        )


def varied_groups(metric: torch.Tensor, group_ids: torch.Tensor, n_groups: int) -> list[int]:
    """Groups whose samples did not all score alike (the only ones with a GRPO gradient)."""
    return [g for g in range(n_groups) if metric[group_ids == g].unique().numel() > 1]
