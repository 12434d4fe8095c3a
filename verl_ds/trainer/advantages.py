"""The advantage phase: each token's reward (the row's score on its last model token, minus the KL to
the reference when the KL is in the reward: classic PPO; GRPO-style runs put it in the loss), the
estimator's advantages and returns (fp32), and on-policy distillation's per-token signal."""

from __future__ import annotations

import torch

from verl_ds import algos
from verl_ds.config import AlgorithmConfig, DistillConfig
from verl_ds.diagnostics.metrics import Timer
from verl_ds.roles.batch import TrainBatch
from verl_ds.rollout import RolloutBatch
from verl_ds.trainer.groups import truncated


def kl_to_reference(logprobs, ref_logprobs, mask, algorithm: AlgorithmConfig) -> torch.Tensor:
    """`[B, R]` per-token KL to the reference (`algorithm.kl_estimator`); zeros without a reference."""
    if ref_logprobs is None:
        return torch.zeros_like(mask)
    return algos.kl_penalty(logprobs, ref_logprobs, algorithm.kl_estimator) * mask


def compute(
    stored: TrainBatch,
    scores: torch.Tensor,
    batch: RolloutBatch,
    algorithm: AlgorithmConfig,
    estimator,
    kl_coef: float,
    distill: DistillConfig | None,
    timer: Timer,
) -> TrainBatch:
    """The train batch: `stored` with each token's advantage and return. `distill` (a teacher's run):
    the teacher's per-token reverse KL added to the task's advantages, or alone."""
    a, mask = algorithm, stored.loss_mask
    kl_in_reward = None
    if not a.use_kl_loss:
        kl_in_reward = kl_to_reference(stored.old_logprobs, stored.ref_logprobs, mask, a) * kl_coef
    rewards = token_rewards(scores, mask, kl_in_reward)
    with timer("adv"):
        adv, returns = estimator(
            token_rewards=rewards,
            scores=rewards.sum(-1),
            values=stored.old_values,
            response_mask=mask,
            group_ids=batch.group_ids,
            gamma=a.gamma,
            lam=a.lam,
        )
        if distill is not None:  # distillation alone, or added to the task's advantages
            if not distill.with_task_reward:
                adv = returns = torch.zeros_like(adv)
            if distill.mode == "reward":  # each token's reward -coef * (log pi_s - log pi_t)
                d_adv = algos.distill_advantages(
                    stored.old_logprobs, stored.teacher_logprobs, mask, distill.coef, distill.discount
                )
                adv, returns = adv + d_adv, returns + d_adv
    if a.mask_truncated:  # samples cut at max_new_tokens teach nothing about endings
        mask = mask * (1 - truncated(batch))[:, None]
    return stored.replace(advantages=adv.float(), returns=returns.float(), loss_mask=mask)


def token_rewards(scores: torch.Tensor, mask: torch.Tensor, kl_penalty: torch.Tensor | None) -> torch.Tensor:
    """`[B, R]` rewards: each sequence's score on its last response token, minus the per-token KL
    penalty when the KL is in the reward."""
    rewards = torch.zeros_like(mask)
    last = mask.cumsum(-1).argmax(-1)  # index of the last response token
    rewards[torch.arange(len(scores)), last] = scores.to(rewards.dtype)
    return rewards - kl_penalty if kl_penalty is not None else rewards
