"""The step's metrics, assembled from what each phase returned and reduced over ranks (rank 0 writes
them): rewards and lengths, the rollout-vs-trainer gap, distillation's KL, each role's precision
signals and padding efficiency. Names: docs/GUIDE.md's glossary."""

from __future__ import annotations

import torch

from verl_ds import algos
from verl_ds.config import AlgorithmConfig
from verl_ds.diagnostics.metrics import Timer, reduce_metrics
from verl_ds.dist import all_reduce_sum
from verl_ds.roles.batch import TrainBatch
from verl_ds.rollout import RolloutBatch
from verl_ds.trainer.consistency import gathered_distribution
from verl_ds.trainer.groups import Collected, truncated


class StepMetrics:
    """What the step reports beside its phases' own metrics; built once per run over its `roles`,
    rollout engine and prompt sampler."""

    def __init__(self, algorithm: AlgorithmConfig, roles: dict, rollout, sampler):
        self.algorithm, self.roles, self.rollout, self.sampler = algorithm, roles, rollout, sampler

    def __call__(
        self,
        got: Collected,
        stored: TrainBatch,
        scores: torch.Tensor,
        old_lp: torch.Tensor | None,
        kl: tuple[float, float],
        phases: dict[str, float],
        timer: Timer,
    ) -> dict[str, float]:
        """`kl`: (this step's KL to the reference over every rank's tokens, the controller's coefficient);
        `phases`: the update's and the sync's metrics."""
        batch = got.batch
        metrics = reduce_metrics(
            {
                **phases,
                **timer.times,
                **timer.memory_metrics(),
                **self.batch(batch, got.raw, scores, old_lp, kl, timer.times["timing_s/step"]),
                **got.metrics,
                **self.distill(stored),
                "response/truncated_fraction": float(truncated(batch).mean()),
                **self.precision(),
            }
        )
        return {**metrics, **self.padding()}

    def batch(self, batch: RolloutBatch, raw_scores, scores, old_lp, kl, step_s: float) -> dict[str, float]:
        mask, a = batch.loss_mask, self.algorithm
        # perf/*; where rollout ranks run apart, what the stream reports (the rows' policy lag, each side's wait)
        apart = ("perf/", "rollout/", "rollout_rank/", "timing_s/rows_wait", "timing_s/rollout_idle")
        rollout_perf = {k: v for k, v in self.rollout.last_metrics.items() if k.startswith(apart)}
        return {
            "reward/mean": raw_scores.mean().item(),
            "reward/normalized_mean": scores.mean().item(),
            "response_length/mean": mask.sum(-1).mean().item(),
            # the tail a synchronous step waits for: on a decode-bound GPU its generation follows the max
            "response_length/p90": mask.sum(-1).quantile(0.9).item() if len(mask) else 0.0,
            "response_length/max": mask.sum(-1).max().item() if len(mask) else 0.0,
            "actor/kl_ref": kl[0],
            "actor/kl_coef": float(kl[1]),
            "data/position": float(self.sampler.epoch * self.sampler.n + self.sampler.pos),
            # rollout-vs-trainer gap on the same weights: precision and sync health
            **{
                f"rollout_corr/{k}": float(v)
                for k, v in algos.mismatch_metrics(old_lp, batch.rollout_logprobs, mask, a.tis_cap).items()
            },
            **self.ratio_distribution(old_lp, batch.rollout_logprobs, mask),
            "perf/throughput": float(batch.attention_mask.sum()) / max(step_s, 1e-9),
            **rollout_perf,
        }

    def ratio_distribution(self, old_lp, rollout_lp, mask) -> dict[str, float]:
        """rollout_corr/ quantiles and clip-band shares over every rank's tokens and rows."""
        out = gathered_distribution(old_lp, rollout_lp, mask, self.algorithm)
        return {f"rollout_corr/{k}": v for k, v in out.items()}

    def distill(self, stored: TrainBatch) -> dict[str, float]:
        """distill/*: the student's per-token reverse KL to the teacher on its own samples (old
        policy, model tokens, mean over every rank's tokens) and the teacher's mean logprob."""
        if "teacher" not in self.roles:
            return {}
        mask, teacher = stored.loss_mask, stored.teacher_logprobs
        kl = algos.reverse_kl(stored.old_logprobs, teacher, mask)
        kl_sum, t_sum, n = all_reduce_sum([float(kl.sum()), float((teacher * mask).sum()), float(mask.sum())])
        return {"distill/reverse_kl/mean": kl_sum / max(n, 1.0), "distill/teacher_logprob/mean": t_sum / max(n, 1.0)}

    def precision(self) -> dict[str, float]:
        out = {}
        for name, role in self.roles.items():
            for k, v in role.precision_stats().items():
                if isinstance(v, float):
                    out[f"precision/{name}/{k}"] = v
        out["actor/grad_norm"] = out.get("precision/actor/grad_norm", float("nan"))
        return out

    def padding(self) -> dict[str, float]:
        """For each role's scoring and update passes of this step (every rank's tokens):
        perf/padding_efficiency/<role>/<pass>: the distinct real tokens / the tokens its forwards ran
        (1.0: no padding ran); perf/shared_tokens/<role>/<pass>: the distinct tokens / the tokens the
        rows hold (1.0: nothing shared; 1/n: n rows ran one prefix once, `roles/prefix.py`)."""
        keys, sums = [], []
        for name, role in self.roles.items():
            for kind, counts in role.take_token_counts().items():
                keys.append(f"{name}/{kind}")
                sums += list(counts)
        sums = all_reduce_sum(sums)  # the same roles on every rank: the same list
        out = {}
        for i, k in enumerate(keys):
            held, distinct, run = sums[3 * i : 3 * i + 3]
            if run:
                out[f"perf/padding_efficiency/{k}"] = distinct / run
            if held:
                out[f"perf/shared_tokens/{k}"] = distinct / held
        return out
