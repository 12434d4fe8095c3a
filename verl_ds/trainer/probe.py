"""The sync's probe: after every weight sync, did every weight reach the rollout engine?

The engine samples a fixed probe (the first training prompts cut short, a fixed seed) at the next
step's generation, while it is awake; the actor scores the same tokens once the roles are awake (on
a GPU the two never hold the device at once). Their logprobs differ by the two formats' rounding
(`algos.probe_bound`), or a weight did not land (one the sync's read-back cannot see: the CPU
backend repacks linear weights, fused q/k/v and gate/up have no checkpoint name). Past the bound the
run stops in one line, before the step trains.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from verl_ds import algos
from verl_ds.errors import RunFailure
from verl_ds.rollout import RolloutBatch
from verl_ds.trainer.groups import scoring_inputs


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
        bound = algos.probe_bound(self.actor_dtype, self.rollout_dtype)
        if not gap <= bound:
            raise RunFailure(
                f"weight sync {sync}: the rollout engine's logprobs of a fixed probe are {gap:.3g} "
                f"from the actor's on the same tokens (mean over {int(mask.sum())}; at most {bound:.3g} for "
                f"{self.actor_dtype} vs {self.rollout_dtype}): a weight did not reach the engine"
            )
        return {"rollout/sync_probe_gap": gap, "timing_s/sync_probe": probe.sample_s + time.perf_counter() - t0}
