"""What the collect phase hands the step (`Collected`), and dynamic sampling's bookkeeping (DAPO
`filter_groups`): which groups carry a GRPO gradient, and how kept groups from several generation
rounds become one batch."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from verl_ds.dist import all_reduce_min, all_reduce_sum
from verl_ds.roles.batch import TrainBatch
from verl_ds.rollout import RolloutBatch


def scoring_inputs(batch: RolloutBatch) -> TrainBatch:
    """What a scoring pass reads of a rollout: its rows, and the model's tokens as the loss mask."""
    return TrainBatch(batch.input_ids, batch.attention_mask, batch.loss_mask)


def truncated(batch: RolloutBatch) -> torch.Tensor:
    """`[B]` 1.0 where the sample was cut at max_new_tokens."""
    return torch.tensor([f == "length" for f in batch.finish_reasons], dtype=batch.loss_mask.dtype)


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


def join_sequence_group(got: Collected, sp) -> Collected:
    """Sequence parallelism (`trainer.sequence_parallel_size`): every rank generated its own prompts' rows,
    and the ranks of an SP group train on the same rows, each split over them; so the group's rows join
    here, in rank order, each rank's groups renumbered past the previous ranks'. The rollout metrics stay
    this rank's (the step reports their mean over every rank). Collective over the group."""
    import torch.distributed as dist

    parts = [None] * sp.size
    dist.all_gather_object(parts, got, group=sp.group)
    return replace(Collected.merge(parts), metrics=got.metrics)


def varied_groups(metric: torch.Tensor, group_ids: torch.Tensor, n_groups: int) -> list[int]:
    """Groups whose samples did not all score alike (the only ones with a GRPO gradient)."""
    return [g for g in range(n_groups) if metric[group_ids == g].unique().numel() > 1]


def collect_varied(
    one_round: Callable[[int], Collected], filter_groups, prompts_per_step: int, world: int
) -> Collected:
    """Dynamic sampling (`algorithm.filter_groups`): groups with zero variance on the chosen metric are
    dropped and `one_round(k)` (round k's rollout, scored) draws more prompts until the step has
    `prompts_per_step` kept groups or `max_rounds` rounds ran; every rank then keeps the same number
    of groups. Collective."""
    fg = filter_groups
    parts, rounds, seen, dropped, drawn = [], 0, 0, 0, []
    while True:
        got = one_round(rounds)
        rounds += 1
        drawn.append(got.raw)
        keep = varied_groups(got.raw if fg.metric == "acc" else got.shaped, got.batch.group_ids, len(got.examples))
        seen, dropped = seen + len(got.examples), dropped + len(got.examples) - len(keep)
        parts.append(got.select_groups(keep))
        kept = all_reduce_sum([float(sum(len(p.examples) for p in parts))])[0]
        if kept >= prompts_per_step or rounds >= fg.max_rounds:
            break
    # the same number of groups on every rank (collectives and micro-batches must match)
    merged = Collected.merge(parts)
    k = int(all_reduce_min(float(min(len(merged.examples), prompts_per_step // world))))
    # nothing varied on some rank: train on the last round as drawn (its advantages are zero)
    out = merged.select_groups(list(range(k))) if k else got
    drawn = torch.cat(drawn)
    seen_all, dropped_all, drawn_sum, drawn_n = all_reduce_sum(
        [float(seen), float(dropped), float(drawn.sum()), float(len(drawn))]
    )
    return replace(
        out,
        metrics={
            **got.metrics,
            "filter/kept_groups": float(k * world),
            "filter/rounds": float(rounds),
            "filter/zero_variance_fraction": dropped_all / max(seen_all, 1.0),
            "filter/reward_mean_drawn": drawn_sum / max(drawn_n, 1.0),  # before filtering
        },
    )
