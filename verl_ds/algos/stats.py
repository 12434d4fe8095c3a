"""Masked statistics and loss aggregation.

Convention (as in verl ``core_algos``): token tensors are ``[batch, response_len]`` and masks are
float 0/1 tensors of the same shape; 1 marks a response token that carries loss/statistics.
Masked positions never contribute, even if they hold inf/nan.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

AGG_LOSS_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

Count = Union[int, float, torch.Tensor]


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Sum of ``x * mask`` over ``dim`` (all elements when None); masked inf/nan are ignored.

    Shapes: ``x`` and ``mask`` broadcastable, e.g. both ``[batch, T]``.
    """
    # where() rather than x * mask alone so that garbage (inf/nan) at masked positions vanishes.
    prod = torch.where(mask != 0, x * mask, 0.0)
    return prod.sum() if dim is None else prod.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Mean of ``x`` over positions where ``mask`` is 1, over ``dim`` (all elements when None).

    Shapes: ``x``, ``mask`` ``[batch, T]`` -> 0-dim (dim=None) or the reduced shape.
    An empty mask gives 0 rather than nan.
    """
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(x, mask, dim) / count.clamp_min(1e-8)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``x`` over all masked positions (a 0-dim tensor).

    Shapes: ``x``, ``mask`` ``[batch, T]``. ``unbiased`` applies Bessel's correction n/(n-1) with
    n = mask.sum(); with n <= 1 the variance is 0 (no correction, no sync, no error).
    """
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        n = mask.sum()
        var = var * n / (n - 1).clamp_min(1.0)
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Whiten ``x`` with the masked mean and unbiased masked variance: (x - mean) / sqrt(var + 1e-8).

    Shapes: ``x``, ``mask`` ``[batch, T]`` -> ``[batch, T]``. With ``shift_mean=False`` the mean is
    added back (scale only), as in verl. Masked positions of the result are 0.
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask != 0, whitened, 0.0)


def agg_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    global_tokens: Optional[Count] = None,
    global_seqs: Optional[Count] = None,
) -> torch.Tensor:
    """Aggregate a per-token loss ``[batch, T]`` into a scalar (0-dim tensor).

    Modes (verl ``agg_loss``):
      * ``token-mean``: sum over all masked tokens / number of masked tokens.
      * ``seq-mean-token-sum``: per-sequence token sum, mean over sequences.
      * ``seq-mean-token-mean``: per-sequence token mean, mean over sequences.
      * ``seq-mean-token-sum-norm`` (Dr.GRPO): per-sequence token sum / T with T = ``loss_mat.shape[-1]``
        (a constant: the max response length), mean over sequences.

    Exact gradient accumulation: pass ``global_tokens`` (masked tokens) and ``global_seqs``
    (sequences) counted over the whole mini-batch across all micro-batches and data-parallel ranks;
    the denominators become those counts so that summing the micro-batch losses over micro-batches
    and ranks gives the full-batch value (for ``seq-mean-token-sum-norm`` all micro-batches must be
    padded to the same T). Without them the local counts are used (a local mean).
    Divide by the data-parallel world size yourself if the gradient all-reduce averages.
    """
    if mode == "token-mean":
        denom = mask.sum() if global_tokens is None else global_tokens
        return masked_sum(loss_mat, mask) / _as_denom(denom, loss_mat)
    if mode == "seq-mean-token-sum":
        seq = masked_sum(loss_mat, mask, dim=-1)
    elif mode == "seq-mean-token-mean":
        seq = masked_mean(loss_mat, mask, dim=-1)
    elif mode == "seq-mean-token-sum-norm":
        seq = masked_sum(loss_mat, mask, dim=-1) / loss_mat.shape[-1]
    else:
        raise ValueError(f"unknown agg_loss mode {mode!r}; known: {AGG_LOSS_MODES}")
    denom = seq.shape[0] if global_seqs is None else global_seqs
    return seq.sum() / _as_denom(denom, loss_mat)


def _as_denom(count: Count, like: torch.Tensor) -> torch.Tensor:
    # A python number or tensor count; clamped so an empty micro-batch yields 0, not nan.
    return torch.as_tensor(count, dtype=torch.float32, device=like.device).clamp_min(1e-8)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021) from `n` samples of which `c` are correct: the chance that
    at least one of `k` samples drawn without replacement is correct. Requires 1 <= k <= n."""
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    prob_all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_wrong *= 1.0 - k / i
    return 1.0 - prob_all_wrong


# Unit roundoff of each compute format: half the gap between 1 and the next number.
UNIT_ROUNDOFF = {"fp32": 2.0**-24, "bf16": 2.0**-8, "fp16": 2.0**-11}


# The share of response tokens a healthy pair may put outside PPO's clip band on the same weights, by the
# coarser format (docs/GUIDE.md, "The consistency contract": peers' measured shares and why these).
MISMATCH_GATE = {"fp32": 0.01, "fp16": 0.03, "bf16": 0.05}


def mismatch_gate_bound(trainer_dtype: str, rollout_dtype: str) -> float:
    """`algorithm.mismatch_gate_fraction`'s default for a trainer/rollout dtype pair: the coarser one's
    `MISMATCH_GATE` share (int8 and unknown formats as bf16)."""
    coarse = max(trainer_dtype, rollout_dtype, key=lambda d: UNIT_ROUNDOFF.get(d, UNIT_ROUNDOFF["bf16"]))
    return MISMATCH_GATE.get(coarse, MISMATCH_GATE["bf16"])


def probe_bound(trainer_dtype: str, rollout_dtype: str) -> float:
    """The mean |rollout - trainer| logprob gap a weight sync's probe may show on the same weights: 64 x
    the coarser format's unit roundoff (one rounding of the logits moves a logprob by a fraction of it;
    kernels that differ, the rollout's packed weights and 16-bit accumulation add a few), at least 1e-4.
    Past it a weight did not land (a stale projection moves every token of the probe)."""
    u = max(UNIT_ROUNDOFF.get(trainer_dtype, 2.0**-24), UNIT_ROUNDOFF.get(rollout_dtype, 2.0**-24))
    return max(1e-4, 64 * u)
