"""Token log-probabilities and entropy from logits, truncated importance sampling, mismatch metrics.

Convention: logits are ``[..., V]`` (typically ``[batch, T, V]``), labels ``[...]`` are token ids.
Logits are upcast to fp32 before any softmax whatever their dtype (fp16/bf16 log-softmax is too
coarse for PPO ratios); results are fp32 (fp64 logits stay fp64). Token tensors elsewhere are
``[batch, T]`` with float 0/1 masks.

``chunk_size`` (rows of the flattened ``[N, V]``) bounds memory: only one ``[chunk_size, V]`` fp32
block exists at a time, in forward and in backward (a custom autograd function recomputes the
softmax per chunk instead of saving fp32 activations; the only full-size buffer is the gradient,
in the logits dtype). The chunked path supports first-order gradients only.
"""

from __future__ import annotations

import math
from typing import Iterator, NamedTuple, Optional

import torch

from .losses import kl_penalty
from .stats import masked_mean

_LOG_RATIO_CLAMP = 20.0


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


class TokenDist(NamedTuple):
    """The distribution a token was sampled from, as the rollout engine processes the logits (vLLM's
    and HF's order and rule): divided by ``temperature``; then the ``top_k`` most likely tokens kept
    (0: all); then, of those, the fewest most likely whose renormalised mass reaches ``top_p``; the
    rest get -inf and the kept ones are renormalised. ``temperature`` 0 is greedy: the raw logits.

    Scoring a sampled token against the whole vocabulary when the engine sampled from a truncated
    set biases every ratio (a token's mass is shared with tokens that could not be drawn), so the
    trainer scores with the same ``TokenDist`` the engine sampled from."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def truncates(self) -> bool:
        return self.temperature > 0 and (self.top_k > 0 or self.top_p < 1.0)

    @property
    def plain(self) -> bool:
        """The logits as they are: no temperature to divide by and nothing cut."""
        return not self.truncates and self.temperature in (0.0, 1.0)


FULL = TokenDist()
_TRUNCATE_ROWS = 256  # rows sorted at a time: a sort of [rows, V] holds values and int64 indices


def kept_tokens(x: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """``x`` ``[N, V]`` (temperature already applied) -> bool ``[N, V]``: the tokens top-k then top-p
    keep. Top-k keeps every token at least as likely as the k-th (ties kept); top-p sorts the
    top-k's renormalised probabilities ascending and drops the tokens whose cumulative mass is at
    most 1 - top_p, never the most likely one."""
    keep = torch.ones_like(x, dtype=torch.bool)
    if 0 < top_k < x.shape[-1]:
        keep = x >= x.topk(top_k, dim=-1).values[:, -1:]
    if top_p < 1.0:
        for s in range(0, x.shape[0], _TRUNCATE_ROWS):
            xs, idx = x[s : s + _TRUNCATE_ROWS].masked_fill(~keep[s : s + _TRUNCATE_ROWS], float("-inf")).sort(-1)
            drop = xs.softmax(-1).cumsum_(-1) <= 1.0 - top_p
            drop[:, -1] = False
            keep[s : s + _TRUNCATE_ROWS] &= ~drop.scatter(-1, idx, drop)
    return keep


def processed_logits(x: torch.Tensor, dist: TokenDist, labels: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x`` ``[N, V]`` -> ``[N, V]`` fp32 logits of the distribution ``dist`` samples from (see
    `TokenDist`), -inf outside its kept set. With ``labels`` ``[N]`` each row's label stays kept:
    the engine drew it from its own kept set, which the trainer's logits recompute exactly only for
    a matched pair; a label a mismatched pair cuts would score -inf. Differentiable w.r.t. ``x``
    (the kept set is a constant)."""
    x = x.to(_compute_dtype(x.dtype))
    if dist.temperature > 0 and dist.temperature != 1.0:
        x = x / dist.temperature
    if dist.truncates:
        with torch.no_grad():
            keep = kept_tokens(x, dist.top_k, dist.top_p)
            if labels is not None:
                keep.scatter_(-1, labels.reshape(-1, 1), True)
        x = x.masked_fill(~keep, float("-inf"))
    return x


def processed_logprobs(logits: torch.Tensor, dist: TokenDist) -> torch.Tensor:
    """log-softmax of the distribution ``dist`` samples from: ``[..., V]`` -> ``[..., V]`` fp32, -inf
    outside the kept set. The rollout engines' recorded logprobs."""
    flat = logits.reshape(-1, logits.shape[-1])
    return torch.log_softmax(processed_logits(flat, dist), dim=-1).view(logits.shape)


def logprobs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, chunk_size: Optional[int] = None, dist: TokenDist = FULL
) -> torch.Tensor:
    """log p(label) under ``dist`` (`TokenDist`; the default: log softmax(logits)[label]): ``logits``
    ``[..., V]``, ``labels`` ``[...]`` (long) -> ``[...]`` fp32.

    Differentiable w.r.t. ``logits``. With ``chunk_size`` the rows are processed in chunks (see the
    module docstring); results agree with the unchunked path.
    """
    if chunk_size is None:
        x = _processed(logits.reshape(-1, logits.shape[-1]), dist, labels.reshape(-1)).view(logits.shape)
        picked = x.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        return picked - torch.logsumexp(x, dim=-1)
    return _ChunkedLogprob.apply(logits, labels, int(chunk_size), False, dist)[0]


def logprobs_and_entropy(
    logits: torch.Tensor, labels: torch.Tensor, chunk_size: int, dist: TokenDist = FULL
) -> tuple[torch.Tensor, torch.Tensor]:
    """``logprobs_from_logits`` and the entropy (of ``dist``) from one pass over each chunk: the
    entropy reuses the chunk's log-normalizer instead of a second softmax. The entropy is detached
    (a metric); an entropy bonus needs ``entropy_from_logits``'s gradient."""
    return _ChunkedLogprob.apply(logits, labels, int(chunk_size), True, dist)


def entropy_from_logits(
    logits: torch.Tensor,
    chunk_size: Optional[int] = None,
    dist: TokenDist = FULL,
    labels: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Entropy of ``dist``'s distribution (the default: softmax(logits)): ``logits`` ``[..., V]`` ->
    ``[...]`` fp32, H = -sum p log p; ``labels`` kept in a truncated set (`processed_logits`).

    Differentiable w.r.t. ``logits`` (for an entropy bonus); -inf logits (masked vocabulary) are
    handled (0 * log 0 = 0). With ``chunk_size`` the rows are processed in chunks.
    """
    if chunk_size is None:
        flat = None if labels is None else labels.reshape(-1)
        return _entropy(_processed(logits.reshape(-1, logits.shape[-1]), dist, flat)).view(logits.shape[:-1])
    return _ChunkedEntropy.apply(logits, int(chunk_size), dist, labels)


def token_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    dist: TokenDist,
    with_entropy: bool,
    entropy_grad: bool,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(log p(label), the entropy or None) under ``dist``, chunked: one pass for both where the
    entropy is a metric; a differentiable pass of its own for an entropy bonus (``entropy_grad``
    while grad is enabled)."""
    if with_entropy and not (torch.is_grad_enabled() and entropy_grad):
        return logprobs_and_entropy(logits, labels, chunk_size, dist)
    logprob = logprobs_from_logits(logits, labels, chunk_size, dist)
    return logprob, entropy_from_logits(logits, chunk_size, dist, labels) if with_entropy else None


def _processed(x: torch.Tensor, dist: TokenDist, labels: Optional[torch.Tensor]) -> torch.Tensor:
    """`processed_logits`, or ``x`` upcast alone where ``dist`` changes nothing (the fused path)."""
    return x.to(_compute_dtype(x.dtype)) if dist.plain else processed_logits(x, dist, labels)


def _entropy(x: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(x, dim=-1)
    # Clamp -inf so that p * log p is 0 (not nan) for zero-probability tokens, in value and gradient.
    logp = logp.clamp_min(torch.finfo(logp.dtype).min)
    return -(logp.exp() * logp).sum(-1)


def _row_blocks(x: torch.Tensor, max_rows: int) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield (first flattened row, [rows, V] tensor) covering ``x`` ``[..., V]`` in row-major order.

    A viewable ``x`` is one block, no copy. A non-viewable one (such as ``logits[:, :-1]``) is copied
    a few leading-dim slices at a time, at most ``max_rows`` rows per copy (one slice if it alone is
    bigger, recursing into it): never a full copy, and not one small op chain per sequence either.
    """
    if x.dim() <= 2:
        yield 0, x.reshape(-1, x.shape[-1])
        return
    try:
        yield 0, x.view(-1, x.shape[-1])
        return
    except RuntimeError:
        pass
    rows_per = x[0].numel() // x.shape[-1]
    if rows_per > max_rows:
        for i in range(x.shape[0]):
            for start, block in _row_blocks(x[i], max_rows):
                yield i * rows_per + start, block
        return
    step = max_rows // rows_per
    for i in range(0, x.shape[0], step):
        yield i * rows_per, x[i : i + step].reshape(-1, x.shape[-1])


def _chunks(x: torch.Tensor, chunk_size: int) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield (first flattened row, [<=chunk_size, V] chunk in the logits' dtype) covering ``x``
    ``[..., V]``; the softmaxes upcast inside their kernels (``dtype=``), not as a separate copy."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    for offset, block in _row_blocks(x, chunk_size):
        for s in range(0, block.shape[0], chunk_size):
            yield offset + s, block[s : s + chunk_size]


class _ChunkedLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, chunk_size, with_entropy, dist):
        flat_labels = labels.reshape(-1)
        out = torch.empty(flat_labels.shape, dtype=_compute_dtype(logits.dtype), device=logits.device)
        ent = torch.empty(flat_labels.shape if with_entropy else (0,), dtype=out.dtype, device=out.device)
        dtype = out.dtype
        for r, x in _chunks(logits, chunk_size):
            n = x.shape[0]
            if not dist.plain:
                x = processed_logits(x, dist, flat_labels[r : r + n])
            # one fused log-softmax per chunk (torch.logsumexp is several passes over [n, V] on CPU)
            logp = torch.log_softmax(x, dim=-1, dtype=dtype)
            out[r : r + n] = logp.gather(-1, flat_labels[r : r + n].unsqueeze(-1)).squeeze(-1)
            if with_entropy:  # H = -sum p log p; -inf logits: log p clamped finite, so 0 * log p = 0
                logp.clamp_min_(torch.finfo(dtype).min)
                ent[r : r + n] = -(logp.exp() * logp).sum(-1)
        ctx.save_for_backward(logits, labels)
        ctx.chunk_size, ctx.dist = chunk_size, dist
        ent = ent.view(labels.shape) if with_entropy else ent
        ctx.mark_non_differentiable(ent)
        return out.view(labels.shape), ent

    @staticmethod
    def backward(ctx, grad_out, _grad_entropy):
        logits, labels = ctx.saved_tensors
        flat_labels, flat_grad = labels.reshape(-1), grad_out.reshape(-1)
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        grad_rows = grad.view(-1, logits.shape[-1])
        dtype, dist = _compute_dtype(logits.dtype), ctx.dist
        for r, x in _chunks(logits, ctx.chunk_size):
            n = x.shape[0]
            g = flat_grad[r : r + n].to(dtype).unsqueeze(-1)
            if not dist.plain:  # the same kept set as the forward's; x / T scales the gradient by 1 / T
                x = processed_logits(x, dist, flat_labels[r : r + n])
                g = g / dist.temperature  # not plain: T > 0
            # d logp[label] / d x = onehot(label) - softmax(x) (0 outside a kept set)
            gx = torch.softmax(x, dim=-1, dtype=dtype).mul_(-g)
            gx.scatter_add_(-1, flat_labels[r : r + n].unsqueeze(-1), g)
            grad_rows[r : r + n] = gx.to(grad.dtype)
        return grad, None, None, None, None


class _ChunkedEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, chunk_size, dist, labels):
        n_rows = logits.numel() // logits.shape[-1]
        out = torch.empty(n_rows, dtype=_compute_dtype(logits.dtype), device=logits.device)
        flat_labels = None if labels is None else labels.reshape(-1)
        for r, x in _chunks(logits, chunk_size):
            rows = None if flat_labels is None else flat_labels[r : r + x.shape[0]]
            out[r : r + x.shape[0]] = _entropy(_processed(x, dist, rows))
        ctx.save_for_backward(logits, flat_labels)
        ctx.chunk_size, ctx.dist = chunk_size, dist
        return out.view(logits.shape[:-1])

    @staticmethod
    def backward(ctx, grad_out):
        logits, flat_labels = ctx.saved_tensors
        dist = ctx.dist
        flat_grad = grad_out.reshape(-1)
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        grad_rows = grad.view(-1, logits.shape[-1])
        for r, x in _chunks(logits, ctx.chunk_size):
            n = x.shape[0]
            x = _processed(x, dist, None if flat_labels is None else flat_labels[r : r + n])
            logp = torch.log_softmax(x, dim=-1, dtype=_compute_dtype(x.dtype))
            logp = logp.clamp_min(torch.finfo(logp.dtype).min)
            p = logp.exp()
            ent = -(p * logp).sum(-1, keepdim=True)
            # dH/dx_j = -p_j * (log p_j + H)
            gx = -flat_grad[r : r + n].to(logp.dtype).unsqueeze(-1) * p * (logp + ent)
            if not dist.plain:  # T > 0
                gx = gx / dist.temperature
            grad_rows[r : r + n] = gx.to(grad.dtype)
        return grad, None, None, None


def tis_weights(
    train_logprob: torch.Tensor,
    rollout_logprob: torch.Tensor,
    response_mask: torch.Tensor,
    cap: float = 2.0,
    level: str = "token",
    mode: str = "truncate",
) -> torch.Tensor:
    """Importance weights of the behaviour (rollout) policy against the trainer's (detached): the
    rollout engine's precision gap, and with partial rollouts the tokens older weights sampled
    (decoupled PPO: `train_logprob` is then the proximal policy, the weights the update starts from).

    Shapes: all ``[batch, T]`` -> ``[batch, T]``. log-ratio = train_logprob - rollout_logprob.
      * ``level="token"``: w_t = exp(log-ratio_t); ``level="sequence"``: w = exp(sum_t mask_t *
        log-ratio_t), broadcast over tokens.
      * ``mode="truncate"`` (TIS): min(w, cap); ``mode="mask"`` (AReaL's decoupled loss): w where
        w <= cap, else 0 (the token drops out of the loss).
    Log-ratios are clamped to [-20, 20] before exp. Masked positions get weight 0 (so a weighted
    masked sum is unaffected by them). Detached: weights are constants in the loss.
    """
    log_ratio = torch.where(response_mask != 0, (train_logprob - rollout_logprob).detach(), 0.0)
    if level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True)
    elif level != "token":
        raise ValueError(f"unknown tis level {level!r}; known: ('token', 'sequence')")
    weights = log_ratio.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP).exp()
    if mode == "truncate":
        weights = weights.clamp(max=cap)
    elif mode == "mask":
        weights = torch.where(weights <= cap, weights, 0.0)
    else:
        raise ValueError(f"unknown tis mode {mode!r}; known: ('truncate', 'mask')")
    return (weights * response_mask).detach()


def mismatch_metrics(
    train_logprob: torch.Tensor,
    rollout_logprob: torch.Tensor,
    response_mask: torch.Tensor,
    cap: float | None = None,
) -> dict[str, torch.Tensor]:
    """Trainer-vs-rollout log-prob mismatch over masked tokens; values are 0-dim detached tensors.

    Shapes: all ``[batch, T]``. Keys:
      * ``logprob_abs_diff_mean`` / ``logprob_abs_diff_max``: mean / max of |train - rollout|.
      * ``k3_kl``: masked mean of the k3 estimate of KL(pi_rollout || pi_train) (tokens are sampled
        from the rollout policy), i.e. ``kl_penalty(rollout, train, "k3")`` (clamped as there).
      * ``prob_pearson``: Pearson correlation of exp(train) and exp(rollout); 0 when either has zero
        variance (e.g. a single token).
      * ``is_ess``: the effective sample size of the importance weights exp(train - rollout) over
        the masked tokens, as a fraction of their count: (sum w)^2 / (n sum w^2), 1 when every weight
        is equal (partial rollouts' stale tokens lower it).
      * ``is_weight_mean`` / ``is_weight_max``: those weights' masked mean and max; with ``cap``,
        ``is_capped_fraction``: the fraction above it (what `tis_weights` truncates or masks).
    An empty mask gives 0 for every key.
    """
    with torch.no_grad():
        mask = response_mask
        log_ratio = train_logprob - rollout_logprob
        diff, ratio = log_ratio.abs(), log_ratio.exp()
        valid = mask != 0
        max_diff = torch.where(valid, diff, 0.0).max() if diff.numel() else diff.new_zeros(())
        p_train, p_roll = train_logprob.exp(), rollout_logprob.exp()
        c_train = p_train - masked_mean(p_train, mask)
        c_roll = p_roll - masked_mean(p_roll, mask)
        cov = masked_mean(c_train * c_roll, mask)
        denom = (masked_mean(c_train.square(), mask) * masked_mean(c_roll.square(), mask)).sqrt()
        pearson = torch.where(denom > 1e-12, cov / denom.clamp_min(1e-12), 0.0)
        w = torch.where(valid, ratio, 0.0)
        n = valid.sum()
        ess = torch.where(n > 0, w.sum().square() / (n * w.square().sum()).clamp_min(1e-30), 0.0)
        return {
            "logprob_abs_diff_mean": masked_mean(diff, mask),
            "logprob_abs_diff_max": max_diff,
            "k3_kl": masked_mean(kl_penalty(rollout_logprob, train_logprob, "k3"), mask),
            "prob_pearson": pearson,
            "is_ess": ess,
            "is_weight_mean": masked_mean(ratio, mask),
            "is_weight_max": torch.where(valid, ratio, 0.0).max() if ratio.numel() else ratio.new_zeros(()),
            **({"is_capped_fraction": masked_mean((ratio > cap).float(), mask)} if cap is not None else {}),
        }


def log_ratios(
    train_logprob: torch.Tensor, rollout_logprob: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(each masked token's log ratio train - rollout ``[n_tokens]``, each row's mean log ratio
    ``[rows with a token]``: the sequence-level ratio GSPO clips, its log normalised by length) in fp64,
    for `ratio_distribution` (gathered over ranks first, the quantiles are the whole batch's)."""
    with torch.no_grad():
        valid = response_mask != 0
        lr = (train_logprob.double() - rollout_logprob.double()) * valid
        n = valid.sum(-1)
        return lr[valid], lr.sum(-1)[n > 0] / n[n > 0]


RATIO_QUANTILES = (0.5, 0.95, 0.99)


def ratio_distribution(
    token_log_ratio: torch.Tensor, seq_log_ratio: torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.2
) -> dict[str, float]:
    """The whole distribution of the trainer-vs-rollout log ratios (`log_ratios`), not its mean:
      * ``phantom_clip_fraction``: the tokens whose ratio lies outside [1 - clip_low, 1 + clip_high]:
        what PPO would clip if the rollout's logprobs were the old policy's; on the same weights
        (every step's first pass) precision alone. ``seq_phantom_clip_fraction``: the rows whose
        sequence ratio does;
      * ``log_ratio_abs_p50/p95/p99/max``: quantiles of |log ratio| over tokens; ``seq_log_ratio_abs_*``
        the same over rows. A mean of 1e-3 can hide a p99 of 0.3 (a few tokens the trainer sees
        otherwise): the tail is what clipping and importance weights act on.
    Empty inputs give 0 for every key."""
    lo, hi = math.log1p(-clip_low) if clip_low < 1 else -math.inf, math.log1p(clip_high)
    out = {}
    for prefix, x in (("", token_log_ratio), ("seq_", seq_log_ratio)):
        x = x.double()
        a = x.abs()
        out[f"{prefix}phantom_clip_fraction"] = float(((x < lo) | (x > hi)).double().mean()) if len(x) else 0.0
        qs = torch.quantile(a, torch.tensor(RATIO_QUANTILES, dtype=a.dtype)) if len(a) else [0.0] * 3
        for q, v in zip(RATIO_QUANTILES, qs):
            out[f"{prefix}log_ratio_abs_p{round(q * 100)}"] = float(v)
        out[f"{prefix}log_ratio_abs_max"] = float(a.max()) if len(a) else 0.0
    return out


class FP32LMHead(torch.nn.Linear):
    """The output projection in fp32 from 16-bit hidden states and weights: the cheapest fix for the
    rollout-vs-trainer probability gap under bf16. Swapped in by class (`use_fp32_lm_head`), so the
    (possibly tied) parameter and any hooks on the module (DeepSpeed ZeRO-3) stay the original's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.float()
        return torch.nn.functional.linear(x.float(), self.weight.float(), bias)


def use_fp32_lm_head(model: torch.nn.Module) -> None:
    """Make an HF causal LM compute its logits in fp32 (`get_output_embeddings()` must be a Linear)."""
    head = model.get_output_embeddings()
    if type(head) not in (torch.nn.Linear, FP32LMHead):
        raise ValueError(f"an fp32 LM head needs a plain Linear output layer, got {type(head).__name__}")
    head.__class__ = FP32LMHead
