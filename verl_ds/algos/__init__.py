"""Core RL math for verl_ds: pure torch functions, no I/O, no config objects.

Modelled on verl's ``verl/trainer/ppo/core_algos.py``. Token tensors are ``[batch, response_len]``,
masks float 0/1 of that shape, sequence scores and group ids ``[batch]``.
"""

from .advantages import (
    ADVANTAGE_ESTIMATORS,
    ESTIMATORS_NEEDING_CRITIC,
    GROUP_ESTIMATORS,
    compute_gae,
    discounted_returns,
    get_advantage_estimator,
    grpo_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from .distill import distill_advantages, reverse_kl
from .logprobs import (
    FP32LMHead,
    entropy_from_logits,
    logprobs_and_entropy,
    logprobs_from_logits,
    mismatch_metrics,
    tis_weights,
    use_fp32_lm_head,
)
from .losses import (
    KL_KINDS,
    POLICY_LOSSES,
    AdaptiveKLController,
    FixedKLController,
    cispo_policy_loss,
    get_policy_loss,
    gspo_policy_loss,
    kl_penalty,
    policy_loss,
    value_loss,
)
from .rewards import REWARD_NORM_MODES, RunningMeanStd, normalize_rewards, overlong_penalty
from .stats import AGG_LOSS_MODES, agg_loss, masked_mean, masked_sum, masked_var, masked_whiten, pass_at_k

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGG_LOSS_MODES",
    "ESTIMATORS_NEEDING_CRITIC",
    "GROUP_ESTIMATORS",
    "KL_KINDS",
    "POLICY_LOSSES",
    "REWARD_NORM_MODES",
    "AdaptiveKLController",
    "FixedKLController",
    "RunningMeanStd",
    "agg_loss",
    "cispo_policy_loss",
    "compute_gae",
    "discounted_returns",
    "distill_advantages",
    "entropy_from_logits",
    "get_advantage_estimator",
    "get_policy_loss",
    "grpo_advantages",
    "gspo_policy_loss",
    "kl_penalty",
    "logprobs_and_entropy",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "mismatch_metrics",
    "normalize_rewards",
    "overlong_penalty",
    "pass_at_k",
    "policy_loss",
    "reinforce_pp_advantages",
    "reverse_kl",
    "reinforce_pp_baseline_advantages",
    "rloo_advantages",
    "tis_weights",
    "use_fp32_lm_head",
    "FP32LMHead",
    "value_loss",
]
