"""The sync's check: after every weight sync, did every weight reach the rollout engine?

Where the step's own rows can tell (`precision.resolve_sync_check`: "rows"), the actor's first scoring of them —
the old-policy pass, or an on-policy update's first forward, before any optimizer step — is compared
with the engine's logprobs of the same tokens: the synced weights against themselves, at no cost.
Partial rollouts (tokens older weights sampled) and a truncated sampling set on a mixed-precision pair
(the kept set recomputed from other logits) cannot: there the probe runs. The engine samples a fixed
probe (the first training prompts cut short, a fixed seed) at the next step's generation, while it is
awake; the actor scores the same tokens once the roles are awake (on a GPU the two never hold the
device at once). Either way the logprobs differ by the two formats' rounding (`algos.probe_bound`), or
a weight did not land (one the sync's read-back cannot see: the CPU backend repacks linear weights,
fused q/k/v and gate/up have no checkpoint name). Past the bound the run stops in one line, before
the step trains.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from verl_ds import algos
from verl_ds.dist import all_reduce_sum
from verl_ds.errors import RunFailure
from verl_ds.rollout import RolloutBatch
from verl_ds.trainer.groups import scoring_inputs

log = logging.getLogger(__name__)


@dataclass
class Probe:
    """What the engine sampled, and the seconds it took."""

    batch: RolloutBatch
    sample_s: float


class SyncProbe:
    PROMPTS, PROMPT_TOKENS, TOKENS = 2, 32, 4  # one engine call, a few ms of scoring

    def __init__(self, prompts: list[dict], seed: int, temperature: float, actor_dtype: str, rollout_dtype: str):
        self.prompts = [list(p["prompt_ids"])[-self.PROMPT_TOKENS :] for p in prompts[: self.PROMPTS]]
        self.seeds = [seed + i for i in range(len(self.prompts))]
        self.temperature = temperature
        self.actor_dtype, self.rollout_dtype = actor_dtype, rollout_dtype

    def sample(self, rollout) -> Probe:
        """The engine's tokens of the probe, and their logprobs, on the weights it holds now."""
        t0 = time.perf_counter()
        batch = rollout.generate(self.prompts, 1, self.temperature, 1.0, self.TOKENS, seeds=self.seeds)
        return Probe(batch, time.perf_counter() - t0)

    def check(self, probe: Probe, actor, sync: int) -> dict[str, float]:
        """The actor's logprobs of the probe's tokens against the engine's; past the bound the run stops
        (sync `sync` named). Collective: every rank scores the same probe."""
        t0 = time.perf_counter()
        ro = probe.batch
        mine = actor.logprobs(scoring_inputs(ro), algos.TokenDist(self.temperature)).cpu()
        mask = ro.loss_mask
        gap = float(((mine - ro.rollout_logprobs).abs() * mask).sum() / mask.sum().clamp(min=1))
        self._judge(gap, sync, "a fixed probe", int(mask.sum()))
        return {"rollout/sync_probe_gap": gap, "timing_s/sync_probe": probe.sample_s + time.perf_counter() - t0}

    def check_rows(self, mine: torch.Tensor, ro: RolloutBatch, sync: int) -> dict[str, float]:
        """The actor's first logprobs of the step's rows `mine` `[B, R]` (before any optimizer step)
        against the engine's; past the bound the run stops. Collective: the gap is every rank's tokens'."""
        t0 = time.perf_counter()
        mask = ro.loss_mask
        diff, n = all_reduce_sum([float(((mine.cpu() - ro.rollout_logprobs).abs() * mask).sum()), float(mask.sum())])
        gap = diff / max(n, 1.0)
        self._judge(gap, sync, "this step's rows", int(n))
        return {"rollout/sync_rows_gap": gap, "timing_s/sync_rows": time.perf_counter() - t0}

    def _judge(self, gap: float, sync: int, what: str, tokens: int) -> None:
        bound = algos.probe_bound(self.actor_dtype, self.rollout_dtype)
        if not gap <= bound:
            raise RunFailure(
                f"weight sync {sync}: the rollout engine's logprobs of {what} are {gap:.3g} "
                f"from the actor's on the same tokens (mean over {tokens}; at most {bound:.3g} for "
                f"{self.actor_dtype} vs {self.rollout_dtype}): a weight did not reach the engine"
            )
