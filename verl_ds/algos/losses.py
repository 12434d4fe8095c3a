"""KL penalties, the policy losses (PPO, GSPO, CISPO), the clipped value loss and KL-coefficient controllers.

Convention (verl ``core_algos``): token tensors are ``[batch, T]``, masks float 0/1 ``[batch, T]``,
log-probabilities are of the sampled tokens. Losses return ``(loss, metrics)`` where ``loss`` is a
0-dim tensor (aggregated by :func:`agg_loss`) and ``metrics`` maps names to 0-dim detached tensors
(local to this micro-batch; the caller reduces them).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .stats import Count, agg_loss, masked_mean

KL_KINDS = ("k1", "k2", "k3", "low_var_kl", "abs")
POLICY_LOSSES = ("vanilla", "gspo", "cispo")

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]

# exp() of a log-ratio beyond this overflows fp32 soon after and is meaningless anyway.
_LOG_RATIO_CLAMP = 20.0
# GSPO clamps its (sequence) log-ratio from above only, at 10, as verl.
_GSPO_LOG_RATIO_MAX = 10.0


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman's k1/k2/k3 estimators).

    Shapes: ``logprob``, ``ref_logprob`` ``[batch, T]`` (any equal shapes) -> same shape.
      * ``k1`` (alias ``kl``): logprob - ref, unclamped (unbiased, high variance, can be negative).
      * ``k2`` (alias ``mse``): 0.5 * (logprob - ref)^2.
      * ``k3`` (alias ``low_var_kl``): exp(ref - logprob) - (ref - logprob) - 1 >= 0. The log-ratio
        ref - logprob is clamped to [-20, 20] before exp (no overflow), and the result to [-10, 10]
        (bounds the gradient from outlier tokens), as verl.
      * ``abs``: |logprob - ref|.
    Unknown ``kind`` raises ValueError.
    """
    if kind in ("k1", "kl"):
        return logprob - ref_logprob
    if kind in ("k2", "mse"):
        return 0.5 * (logprob - ref_logprob).square()
    if kind in ("k3", "low_var_kl"):
        log_ratio = (ref_logprob - logprob).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        return (log_ratio.exp() - log_ratio - 1).clamp(-10.0, 10.0)
    if kind == "abs":
        return (logprob - ref_logprob).abs()
    raise ValueError(f"unknown kl kind {kind!r}; known: {KL_KINDS}")


def policy_loss(
    old_logprob: torch.Tensor,
    logprob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip_c: Optional[float] = None,
    agg_mode: str = "token-mean",
    is_weights: Optional[torch.Tensor] = None,
    global_tokens: Optional[Count] = None,
    global_seqs: Optional[Count] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate loss (Schulman et al. 2017), with optional dual clip (Ye et al. 2020).

    Shapes: all tensors ``[batch, T]`` -> ``(loss 0-dim, metrics)``.
    ratio = exp(logprob - old_logprob) with the log-ratio clamped to [-20, 20];
    per-token loss = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high)) (asymmetric
    clip_high > clip_low is DAPO's clip-higher). Dual clip: for A < 0 only and only when
    ``dual_clip_c`` (> 1) is given, the loss is further capped at -A * c. ``is_weights`` (e.g.
    :func:`tis_weights`; treated as constants) multiplies the per-token loss. Aggregated with :func:`agg_loss`
    (``agg_mode``, ``global_tokens``, ``global_seqs`` forwarded).
    Metrics: ``pg_clipfrac`` (fraction of tokens where the clipped term is active),
    ``pg_clipfrac_lower`` (fraction where the dual clip is active), ``ppo_kl`` (masked mean of
    old_logprob - logprob).
    """
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")
    log_ratio = (logprob - old_logprob).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = log_ratio.exp()
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    losses = torch.maximum(loss_unclipped, loss_clipped)
    clipfrac = masked_mean((loss_clipped > loss_unclipped).float(), response_mask)

    if dual_clip_c is not None:
        loss_dual = -advantages * dual_clip_c
        negative = advantages < 0
        clipfrac_lower = masked_mean(((losses > loss_dual) & negative).float(), response_mask)
        losses = torch.where(negative, torch.minimum(losses, loss_dual), losses)
    else:
        clipfrac_lower = torch.zeros((), device=losses.device)

    ppo_kl = masked_mean(old_logprob - logprob, response_mask)
    loss = _aggregate(losses, response_mask, agg_mode, is_weights, global_tokens, global_seqs)
    return loss, _metrics(clipfrac, clipfrac_lower, ppo_kl)


def gspo_policy_loss(
    old_logprob: torch.Tensor,
    logprob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip_c: Optional[float] = None,
    agg_mode: str = "token-mean",
    is_weights: Optional[torch.Tensor] = None,
    global_tokens: Optional[Count] = None,
    global_seqs: Optional[Count] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025, arXiv:2507.18071), token form as verl ``compute_policy_loss_gspo``.

    Shapes: all tensors ``[batch, T]`` -> ``(loss 0-dim, metrics)``.
    Sequence ratio s_i = exp(masked mean over the response of logprob - old_logprob). Token ratio
    s_it = sg[s_i] * exp(logprob - sg[logprob]): value s_i, gradient s_i * d logprob_t, so that per-token
    advantages still apply. Its log is clamped at 10 (as verl). Per-token loss and clip as
    :func:`policy_loss` with s_it for the ratio; ``dual_clip_c`` is ignored (as verl); ``agg_mode`` is
    honoured (as verl 0.9; the paper uses ``seq-mean-token-mean``). Metrics as :func:`policy_loss`,
    ``pg_clipfrac_lower`` is 0.
    """
    seq_log_ratio = masked_mean(logprob - old_logprob, response_mask, dim=-1).detach()
    log_ratio = (logprob - logprob.detach() + seq_log_ratio.unsqueeze(-1)).clamp(max=_GSPO_LOG_RATIO_MAX)
    ratio = log_ratio.exp()
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    losses = torch.maximum(loss_unclipped, loss_clipped)
    clipfrac = masked_mean((loss_clipped > loss_unclipped).float(), response_mask)
    ppo_kl = masked_mean(old_logprob - logprob, response_mask)
    loss = _aggregate(losses, response_mask, agg_mode, is_weights, global_tokens, global_seqs)
    return loss, _metrics(clipfrac, torch.zeros((), device=losses.device), ppo_kl)


def cispo_policy_loss(
    old_logprob: torch.Tensor,
    logprob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip_c: Optional[float] = None,
    agg_mode: str = "token-mean",
    is_weights: Optional[torch.Tensor] = None,
    global_tokens: Optional[Count] = None,
    global_seqs: Optional[Count] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1, arXiv:2506.13585), as verl ``compute_policy_loss_cispo``.

    Shapes: all tensors ``[batch, T]`` -> ``(loss 0-dim, metrics)``.
    Per-token loss = -sg[clip(ratio, 1 - clip_low, 1 + clip_high)] * A * logprob with
    ratio = exp(logprob - old_logprob) (log-ratio clamped to [-20, 20]): the clipped IS weight is a
    constant, so every token keeps a REINFORCE gradient. ``dual_clip_c`` is ignored (as verl).
    Metrics: ``pg_clipfrac`` (fraction of tokens whose ratio is clipped), ``pg_clipfrac_lower`` 0,
    ``ppo_kl`` (masked mean of the clamped old_logprob - logprob).
    """
    log_ratio = (logprob - old_logprob).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = log_ratio.exp()
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    losses = -weight.detach() * advantages * logprob
    clipfrac = masked_mean((ratio != weight).float(), response_mask)
    ppo_kl = masked_mean(-log_ratio, response_mask)
    loss = _aggregate(losses, response_mask, agg_mode, is_weights, global_tokens, global_seqs)
    return loss, _metrics(clipfrac, torch.zeros((), device=losses.device), ppo_kl)


_POLICY_LOSS_FNS: dict[str, PolicyLossFn] = {
    "vanilla": policy_loss,
    "gspo": gspo_policy_loss,
    "cispo": cispo_policy_loss,
}


def get_policy_loss(name: str) -> PolicyLossFn:
    """The policy loss called ``name`` (one of :data:`POLICY_LOSSES`); all share :func:`policy_loss`'s signature."""
    if name not in _POLICY_LOSS_FNS:
        raise ValueError(f"unknown policy loss {name!r}; known: {POLICY_LOSSES}")
    return _POLICY_LOSS_FNS[name]


def _aggregate(losses, mask, agg_mode, is_weights, global_tokens, global_seqs) -> torch.Tensor:
    # Per-token policy losses [batch, T] -> 0-dim: IS weights (constants), then agg_loss.
    if is_weights is not None:
        losses = losses * is_weights.detach()
    return agg_loss(losses, mask, agg_mode, global_tokens=global_tokens, global_seqs=global_seqs)


def _metrics(clipfrac, clipfrac_lower, ppo_kl) -> dict[str, torch.Tensor]:
    return {"pg_clipfrac": clipfrac.detach(), "pg_clipfrac_lower": clipfrac_lower.detach(), "ppo_kl": ppo_kl.detach()}


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    clip: Optional[float] = 0.5,
    agg_mode: str = "token-mean",
    global_tokens: Optional[Count] = None,
    global_seqs: Optional[Count] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss (PPO2 / verl ``compute_value_loss``).

    Shapes: all tensors ``[batch, T]`` -> ``(loss 0-dim, metrics)``.
    Per token 0.5 * max((v - R)^2, (clip(v, old - c, old + c) - R)^2), aggregated with :func:`agg_loss`
    (the 0.5 is applied per token, so it commutes with every mode). ``clip=None`` disables clipping.
    Metric: ``vf_clipfrac``, the fraction of tokens where the clipped term is strictly larger.
    """
    err_unclipped = (values - returns).square()
    if clip is None:
        losses, clipfrac = err_unclipped, torch.zeros((), device=values.device)
    else:
        clipped = torch.clamp(values, old_values - clip, old_values + clip)
        err_clipped = (clipped - returns).square()
        losses = torch.maximum(err_unclipped, err_clipped)
        clipfrac = masked_mean((err_clipped > err_unclipped).float(), response_mask)
    loss = agg_loss(0.5 * losses, response_mask, agg_mode, global_tokens=global_tokens, global_seqs=global_seqs)
    return loss, {"vf_clipfrac": clipfrac.detach()}


class FixedKLController:
    """Constant KL coefficient; ``update`` is a no-op. State: ``{"value": float}``."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. 2019 (as verl / TRL).

    ``update(current_kl, n_steps)``: e = clip(current_kl / target - 1, -0.2, 0.2);
    value *= 1 + e * n_steps / horizon. ``current_kl`` may be a float or a 0-dim tensor.
    State: ``{"value": float}`` (target and horizon come from the constructor, i.e. the config).
    """

    def __init__(self, init: float, target: float, horizon: float):
        if target <= 0 or horizon <= 0:
            raise ValueError("target and horizon must be > 0")
        self.value = float(init)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])
