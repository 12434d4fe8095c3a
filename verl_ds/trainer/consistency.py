"""The consistency contract's numbers beyond the means (docs/GUIDE.md, "The consistency contract"):

- the whole distribution of two passes' log ratios over every rank's tokens (`gathered_distribution`);
- the trainer against itself (`trainer_corr/`): every `logging.consistency_every` steps a few rows
  of each rank's batch are scored again, each alone (`Role.rows_alone`), on the weights the step's
  first scoring ran on, and compared with that scoring (micro-batches, budgets, packing, prefixes);
- the share of response tokens whose rollout-vs-trainer ratio on the same weights falls outside PPO's
  clip band (`rollout_corr/phantom_clip_fraction`), which the gate bounds (`precision.MismatchGate`,
  resolved once with the pair's dtypes: past the bound, one line naming the pair, the step and the
  numbers; a warning, or the end of the run)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from verl_ds import algos
from verl_ds.config import AlgorithmConfig
from verl_ds.dist import all_gather_object
from verl_ds.roles.batch import TrainBatch

log = logging.getLogger(__name__)

ALONE_ROWS = 8  # rows of each rank's batch scored alone: a sample (one forward each)


def gathered_distribution(
    logprobs: torch.Tensor, against: torch.Tensor, mask: torch.Tensor, a: AlgorithmConfig
) -> dict[str, float]:
    """`algos.ratio_distribution` of `logprobs` against `against` over every rank's tokens and rows
    (gathered, so a p99 is the batch's, not a mean of the ranks' p99s). Collective."""
    parts = all_gather_object(algos.log_ratios(logprobs, against, mask))
    tokens, seqs = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    return algos.ratio_distribution(tokens, seqs, a.clip_low, a.clip_high)


@dataclass
class Alone:
    rows: torch.Tensor  # the sampled rows of this rank's batch
    logprobs: torch.Tensor  # `[k, R]` each scored alone


def score_alone(actor, batch: TrainBatch, dist: algos.TokenDist) -> Alone:
    """A few rows, evenly spaced, each scored alone by `actor` (before any optimizer step of the
    step). Collective: every rank runs as many forwards."""
    rows = torch.linspace(0, max(len(batch) - 1, 0), min(ALONE_ROWS, len(batch))).round().long().unique()
    with actor.rows_alone():
        return Alone(rows, actor.logprobs(batch.select(rows), dist).cpu())


def against_itself(composed: torch.Tensor, alone: Alone, mask: torch.Tensor, a: AlgorithmConfig) -> dict[str, float]:
    """trainer_corr/: the actor's logprobs of the sampled rows as its passes ran them (`composed`
    `[B, R]`, the step's first scoring) against each row alone. Collective."""
    c, m = composed[alone.rows], mask[alone.rows]
    out = {k: float(v) for k, v in algos.mismatch_metrics(c, alone.logprobs, m).items()}
    out.update(gathered_distribution(c, alone.logprobs, m, a))
    return {f"trainer_corr/{k}": v for k, v in out.items()}
