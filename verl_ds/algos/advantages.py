"""Advantage estimators: GAE, GRPO / Dr.GRPO, RLOO, REINFORCE++ (+ group baseline), and a registry.

Convention (verl ``core_algos``): token tensors are ``[batch, T]`` with T = response length, masks
are float 0/1 ``[batch, T]``, sequence scores are ``[batch]`` and ``group_ids`` ``[batch]`` (long)
marks the responses sampled from the same prompt. Advantages are 0 at masked positions.
"""

from __future__ import annotations

from typing import Callable

import torch

from .stats import masked_whiten

ADVANTAGE_ESTIMATORS = ("gae", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")
ESTIMATORS_NEEDING_CRITIC = {"gae"}
GROUP_ESTIMATORS = {"grpo", "dr_grpo", "rloo"}  # compare samples of one prompt: need n >= 2


def compute_gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016), not whitened.

    Shapes: ``token_rewards``, ``values``, ``response_mask`` ``[batch, T]`` -> ``(advantages, returns)``
    both ``[batch, T]``, with ``returns = advantages + values`` on response tokens.

    delta_t = r_t + gamma * V_next - V_t, A_t = delta_t + gamma * lam * A_next, where "next" is the next
    position with mask 1 (0 past the end). Positions with mask 0 (padding, or observation tokens in
    multi-turn) are skipped: the next value and the running GAE carry over them unchanged, so the
    values and rewards stored there have no effect. Both outputs are 0 at masked positions.
    """
    dtype = torch.promote_types(token_rewards.dtype, values.dtype)
    token_rewards, values = token_rewards.to(dtype), values.to(dtype)
    mask = response_mask.bool()
    next_value = torch.zeros_like(values[:, 0])
    last_gae = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[-1])):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        gae = delta + gamma * lam * last_gae
        # where(), not a multiply by the mask, so inf/nan stored at skipped positions cannot leak.
        next_value = torch.where(mask[:, t], values[:, t], next_value)
        last_gae = torch.where(mask[:, t], gae, last_gae)
        advantages[:, t] = last_gae
    advantages = torch.where(mask, advantages, 0.0)
    returns = torch.where(mask, advantages + values, 0.0)
    return advantages, returns


def _group_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    # Arbitrary (non-contiguous, unsorted) ids -> dense indices 0..G-1.
    uniq, inverse = torch.unique(group_ids, return_inverse=True)
    return inverse, uniq.numel()


def _group_sum(x: torch.Tensor, index: torch.Tensor, num_groups: int) -> torch.Tensor:
    # Per-group sum gathered back to every member: [batch] -> [batch].
    return torch.zeros(num_groups, dtype=x.dtype, device=x.device).index_add_(0, index, x)[index]


def _float_scores(scores: torch.Tensor) -> torch.Tensor:
    return scores if scores.is_floating_point() else scores.float()


def grpo_advantages(
    scores: torch.Tensor,
    group_ids: torch.Tensor,
    response_mask: torch.Tensor,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO outcome advantages (Shao et al. 2024): (score - group mean) / (group std + eps).

    Shapes: ``scores`` ``[batch]`` (one scalar per sequence), ``group_ids`` ``[batch]``,
    ``response_mask`` ``[batch, T]`` -> ``[batch, T]``, the sequence advantage broadcast over its
    response tokens. The std is unbiased (torch.std). ``norm_by_std=False`` is Dr.GRPO (Liu et al.
    2025): only the group mean is subtracted. A singleton group gets advantage 0 (its mean is its
    own score; there is no baseline to compare against).
    """
    scores = _float_scores(scores)
    index, g = _group_index(group_ids)
    count = _group_sum(torch.ones_like(scores), index, g)
    centered = scores - _group_sum(scores, index, g) / count
    if norm_by_std:
        std = (_group_sum(centered**2, index, g) / (count - 1).clamp_min(1.0)).sqrt()
        centered = centered / (std + eps)
    return centered.unsqueeze(-1) * response_mask


def rloo_advantages(scores: torch.Tensor, group_ids: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """RLOO advantages (Ahmadian et al. 2024): score minus the mean score of the other group members.

    Shapes: ``scores`` ``[batch]``, ``group_ids`` ``[batch]``, ``response_mask`` ``[batch, T]`` ->
    ``[batch, T]`` (broadcast over response tokens). Equivalent to n/(n-1) * (score - group mean).
    A singleton group has no leave-one-out baseline and gets advantage 0 (as GRPO).
    """
    scores = _float_scores(scores)
    index, g = _group_index(group_ids)
    count = _group_sum(torch.ones_like(scores), index, g)
    others_mean = (_group_sum(scores, index, g) - scores) / (count - 1).clamp_min(1.0)
    adv = torch.where(count > 1, scores - others_mean, 0.0)
    return adv.unsqueeze(-1) * response_mask


def reinforce_pp_advantages(token_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """REINFORCE++ advantages (Hu 2025): per-token discounted returns, then masked whitening.

    Shapes: ``token_rewards``, ``response_mask`` ``[batch, T]`` -> ``[batch, T]``.
    G_t = r_t + gamma * G_next, with "next" the next position of mask 1 (masked positions are skipped
    as in :func:`compute_gae`; their rewards are ignored). The returns are whitened over all masked
    tokens of the batch (mean and unbiased std); masked positions are 0.
    """
    return masked_whiten(discounted_returns(token_rewards, response_mask, gamma), response_mask)


def discounted_returns(token_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma * G_next over the positions of mask 1 (masked positions are skipped and
    their rewards ignored; they get 0). ``[batch, T]`` -> ``[batch, T]``. gamma 0: G_t = r_t."""
    mask = response_mask.bool()
    if gamma == 0:
        return torch.where(mask, token_rewards, 0.0)
    running = torch.zeros_like(token_rewards[:, 0])
    returns = torch.zeros_like(token_rewards)
    for t in reversed(range(token_rewards.shape[-1])):
        running = torch.where(mask[:, t], token_rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(mask[:, t], running, 0.0)
    return returns


def reinforce_pp_baseline_advantages(
    scores: torch.Tensor, group_ids: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """REINFORCE++ with a group baseline (verl ``reinforce_plus_plus_baseline``).

    Shapes: ``scores`` ``[batch]``, ``group_ids`` ``[batch]``, ``response_mask`` ``[batch, T]`` ->
    ``[batch, T]``. Subtract the group mean from each score (a singleton group becomes 0), broadcast
    over response tokens, then whiten over all masked tokens of the batch (token-weighted mean and
    unbiased std, as verl). Masked positions are 0.
    """
    return masked_whiten(grpo_advantages(scores, group_ids, response_mask, norm_by_std=False), response_mask)


# ---- registry -------------------------------------------------------------------------------------
# Every registered estimator has the same keyword-only signature:
#   fn(*, token_rewards, scores, values, response_mask, group_ids, gamma, lam) -> (advantages, returns)
# Unused arguments are ignored. Estimators without a critic return (advantages, advantages), as verl.
# For grpo / dr_grpo / rloo / reinforce_pp_baseline, ``scores`` [batch] is the sequence-level reward;
# if the KL penalty is in the reward, the caller passes the token rewards (score + per-token KL) summed
# over the response tokens.


def _require(name: str, **args) -> None:
    missing = [k for k, v in args.items() if v is None]
    if missing:
        raise ValueError(f"advantage estimator {name!r} needs {', '.join(missing)}")


def _gae(*, token_rewards=None, scores=None, values=None, response_mask=None, group_ids=None, gamma=1.0, lam=1.0):
    _require("gae", token_rewards=token_rewards, values=values, response_mask=response_mask)
    return compute_gae(token_rewards, values, response_mask, gamma, lam)


def _group(name: str, fn: Callable) -> Callable:
    def estimator(
        *, token_rewards=None, scores=None, values=None, response_mask=None, group_ids=None, gamma=1.0, lam=1.0
    ):
        _require(name, scores=scores, group_ids=group_ids, response_mask=response_mask)
        adv = fn(scores, group_ids, response_mask)
        return adv, adv

    estimator.__name__ = f"{name}_estimator"
    estimator.__doc__ = f"Registry wrapper of {fn.__name__}: uniform keyword signature -> (advantages, advantages)."
    return estimator


def _reinforce_pp(
    *, token_rewards=None, scores=None, values=None, response_mask=None, group_ids=None, gamma=1.0, lam=1.0
):
    _require("reinforce_pp", token_rewards=token_rewards, response_mask=response_mask)
    adv = reinforce_pp_advantages(token_rewards, response_mask, gamma)
    return adv, adv


_REGISTRY = {
    "gae": _gae,
    "grpo": _group("grpo", grpo_advantages),
    "dr_grpo": _group("dr_grpo", lambda s, g, m: grpo_advantages(s, g, m, norm_by_std=False)),
    "rloo": _group("rloo", rloo_advantages),
    "reinforce_pp": _reinforce_pp,
    "reinforce_pp_baseline": _group("reinforce_pp_baseline", reinforce_pp_baseline_advantages),
}


def get_advantage_estimator(name: str) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """Return the estimator registered under ``name`` (one of :data:`ADVANTAGE_ESTIMATORS`).

    The callable is keyword-only and uniform across estimators:
    ``fn(*, token_rewards, scores, values, response_mask, group_ids, gamma, lam) -> (advantages, returns)``
    with ``token_rewards``/``values``/``response_mask`` ``[batch, T]``, ``scores``/``group_ids``
    ``[batch]``; arguments an estimator does not use are ignored (``values`` may be None unless the
    name is in :data:`ESTIMATORS_NEEDING_CRITIC`). Critic-free estimators return ``returns = advantages``.
    Raises ValueError for an unknown name.
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown advantage estimator {name!r}; known: {', '.join(ADVANTAGE_ESTIMATORS)}") from None
