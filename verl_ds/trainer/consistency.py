"""The consistency contract's gate: the share of response tokens whose rollout-vs-trainer ratio on the
same weights falls outside PPO's clip band (`rollout_corr/phantom_clip_fraction`), bounded. Past the
bound, one line naming the pair, the step and the numbers: a warning, or the end of the run
(`algorithm.mismatch_gate`). The bound and whether the gate can read that share are resolved once
(`resolve_gate`): partial rollouts train tokens older weights sampled, whose ratios are staleness,
not precision."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from verl_ds import algos
from verl_ds.config import RunConfig
from verl_ds.errors import RunFailure

log = logging.getLogger(__name__)


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
    if mode != "off" and cfg.rollout.partial.enabled:
        log.info("mismatch gate: off (rollout.partial: stale tokens' ratios are not the pair's precision)")
        mode = "off"
    elif mode != "off":
        log.info("mismatch gate: %s past %.2g%% of tokens outside the clip band (%s)", mode, 100 * bound, pair)
    return MismatchGate(mode, bound, pair)
