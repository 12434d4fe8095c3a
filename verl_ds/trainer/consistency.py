"""The consistency contract's numbers beyond the means (docs/GUIDE.md, "The consistency contract"):

- the whole distribution of two passes' log ratios over every rank's tokens (`gathered_distribution`);
- the trainer against itself (`trainer_corr/`): every `logging.consistency_every` steps a few rows
  of each rank's batch are scored again, each alone (`Role.rows_alone`), on the weights the step's
  first scoring ran on, and compared with that scoring (micro-batches, budgets, packing, prefixes);
- the gate: the share of response tokens whose rollout-vs-trainer ratio on the same weights falls
  outside PPO's clip band (`rollout_corr/phantom_clip_fraction`), bounded. Past the bound, one line
  naming the pair, the step and the numbers: a warning, or the end of the run
  (`algorithm.mismatch_gate`). The bound and whether the gate can read that share are resolved once
  (`resolve_gate`): partial rollouts train tokens older weights sampled, whose ratios are staleness,
  not precision."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from verl_ds import algos
from verl_ds.config import AlgorithmConfig, RunConfig
from verl_ds.dist import all_gather_object
from verl_ds.errors import RunFailure
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


@dataclass(frozen=True)
class MismatchGate:
    mode: str  # off | warn | stop
    bound: float  # the share of tokens outside the clip band a step may show
    pair: str  # "bf16 actor vs bf16 rollout": named in the line

    def check(self, metrics: dict[str, float], step: int) -> str | None:
        """The step's line past the bound (logged, or raised as the run's end under `stop`); None within it."""
        share = metrics.get("rollout_corr/phantom_clip_fraction")
        if self.mode == "off" or share is None or share <= self.bound:
            return None
        line = (
            f"mismatch gate: step {step}: {share:.2%} of response tokens outside the clip band on the same weights "
            f"({self.pair}; bound {self.bound:.2%}, algorithm.mismatch_gate_fraction); |log ratio| p99 "
            f"{metrics.get('rollout_corr/log_ratio_abs_p99', float('nan')):.3g}, max "
            f"{metrics.get('rollout_corr/log_ratio_abs_max', float('nan')):.3g}, mean IS weight "
            f"{metrics.get('rollout_corr/is_weight_mean', float('nan')):.4f}"
        )
        if self.mode == "stop":
            raise RunFailure(line + " (algorithm.mismatch_gate: stop)")
        log.warning("%s", line)
        return line


def resolve_gate(cfg: RunConfig, trainer_dtype: str, rollout_dtype: str) -> MismatchGate:
    """`algorithm.mismatch_gate` and its bound (`mismatch_gate_fraction`, or the dtypes' default), said in one line."""
    a = cfg.algorithm
    pair = f"{trainer_dtype} actor vs {rollout_dtype} rollout"
    bound = a.mismatch_gate_fraction or algos.mismatch_gate_bound(trainer_dtype, rollout_dtype)
    mode = a.mismatch_gate
    if mode != "off" and cfg.rollout.partial.enabled and cfg.rollout.partial.max_staleness > 0:
        log.info("mismatch gate: off (rollout.partial: stale tokens' ratios are not the pair's precision)")
        mode = "off"
    elif mode != "off" and cfg.trainer.rollout_ranks:
        log.info(
            "mismatch gate: off (trainer.rollout_ranks: rows one step off-policy, their ratios are not the pair's)"
        )
        mode = "off"
    elif mode != "off":
        log.info("mismatch gate: %s past %.2g%% of tokens outside the clip band (%s)", mode, 100 * bound, pair)
    return MismatchGate(mode, bound, pair)


def resolve_sync_check(cfg: RunConfig, trainer_dtype: str, rollout_dtype: str, sampled: algos.TokenDist) -> str:
    """How each sync is verified, said in one line: "rows" (the step's own rows, free), "probe" (a fixed
    probe the engine samples before the roles wake), or "stream" (rollout ranks apart: the probe their
    rollout rank samples on the weights it took, taken once the step's scoring has run, as it arrives
    meanwhile, and checked before the update)."""
    if cfg.trainer.rollout_ranks:
        log.info(
            "sync check: a fixed probe the rollout rank samples on each step's weights (trainer.rollout_ranks: a "
            "step's rows were sampled by the weights before), checked before the update"
        )
        return "stream"
    why = (
        "rollout.partial: a step's rows hold tokens older weights sampled"
        if cfg.rollout.partial.enabled and cfg.rollout.partial.max_staleness > 0
        else f"a truncated sampling set on {trainer_dtype} vs {rollout_dtype}: its kept set comes from other logits"
        if sampled.truncates and trainer_dtype != rollout_dtype
        else ""
    )
    if why:
        log.info("sync check: a fixed probe after each sync (%s)", why)
        return "probe"
    log.info("sync check: the actor's first scoring of each step's rows against the engine's (no extra pass)")
    return "rows"
