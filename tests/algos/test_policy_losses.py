"""GSPO / CISPO / the policy-loss registry against verl 0.9.1's formulas.

The ``_verl_*`` functions transcribe ``verl/trainer/ppo/core_algos.py`` (verl 0.9.1: ``agg_loss``,
``compute_policy_loss_gspo``, ``compute_policy_loss_cispo``) and ``verl.utils.torch_functional``'s
``masked_sum`` / ``masked_mean`` in plain torch, with dp_size = 1 and the ActorConfig fields as arguments.
"""

import pytest
import torch

from verl_ds.algos import (
    AGG_LOSS_MODES,
    POLICY_LOSSES,
    cispo_policy_loss,
    get_policy_loss,
    gspo_policy_loss,
    policy_loss,
)

pytestmark = pytest.mark.numerics  # asserts numbers: rerun with AVX2 kernels (launch/numerics_avx2.sh)


def _verl_masked_sum(values, mask, axis=None):
    valid_values = torch.where(mask.bool(), values, 0.0)
    return (valid_values * mask).sum(axis=axis)


def _verl_masked_mean(values, mask, axis=None):
    return _verl_masked_sum(values, mask, axis) / (mask.sum(axis=axis) + 1e-8)


def _verl_agg_loss(loss_mat, loss_mask, loss_agg_mode, batch_num_tokens=None, global_batch_size=None):
    dp_size = 1
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            batch_num_tokens = loss_mask.sum()
        return _verl_masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size
    if loss_agg_mode in ["seq-mean-token-sum", "seq-mean-token-sum-norm"]:
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        seq_mask = (torch.sum(loss_mask, dim=-1) > 0).float()
        if global_batch_size is None:
            global_batch_size = seq_mask.sum()
        loss = _verl_masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size
        if loss_agg_mode == "seq-mean-token-sum-norm":
            loss = loss / loss_mask.shape[-1]
        return loss
    if loss_agg_mode == "seq-mean-token-mean":
        seq_mask = torch.sum(loss_mask, dim=-1)
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / (seq_mask + 1e-8)
        seq_mask = (seq_mask > 0).float()
        if global_batch_size is None:
            global_batch_size = seq_mask.sum()
        return _verl_masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size
    raise ValueError(loss_agg_mode)


def _verl_gspo(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode,
    clip_ratio_low,
    clip_ratio_high,
    rollout_is_weights=None,
    **batch_info,
):
    negative_approx_kl = log_prob - old_log_prob
    seq_lengths = torch.sum(response_mask, dim=-1).clamp(min=1)
    negative_approx_kl_seq = torch.sum(negative_approx_kl * response_mask, dim=-1) / seq_lengths
    log_seq_importance_ratio = log_prob - log_prob.detach() + negative_approx_kl_seq.detach().unsqueeze(-1)
    log_seq_importance_ratio = torch.clamp(log_seq_importance_ratio, max=10.0)
    seq_importance_ratio = torch.exp(log_seq_importance_ratio)
    pg_losses1 = -advantages * seq_importance_ratio
    pg_losses2 = -advantages * torch.clamp(seq_importance_ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = _verl_agg_loss(pg_losses, response_mask, loss_agg_mode, **batch_info)
    pg_clipfrac = _verl_masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
    ppo_kl = _verl_masked_mean(-negative_approx_kl, response_mask)
    return pg_loss, {"pg_clipfrac": pg_clipfrac.item(), "ppo_kl": ppo_kl.item(), "pg_clipfrac_lower": 0.0}


def _verl_cispo(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode,
    clip_ratio_low,
    clip_ratio_high,
    rollout_is_weights=None,
    **batch_info,
):
    negative_approx_kl = log_prob - old_log_prob
    negative_approx_kl = torch.clamp(negative_approx_kl, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = _verl_masked_mean(-negative_approx_kl, response_mask)
    clipped_ratio = torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clipped_ratio_sg = clipped_ratio.detach()
    pg_losses = -clipped_ratio_sg * advantages * log_prob
    pg_clipfrac = _verl_masked_mean((ratio != clipped_ratio).float(), response_mask)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = _verl_agg_loss(pg_losses, response_mask, loss_agg_mode, **batch_info)
    return pg_loss, {"pg_clipfrac": pg_clipfrac.item(), "ppo_kl": ppo_kl.item(), "pg_clipfrac_lower": 0.0}


OURS_AND_VERL = [(gspo_policy_loss, _verl_gspo), (cispo_policy_loss, _verl_cispo)]
CLIP_LOW, CLIP_HIGH = 0.1, 0.15


def _batch(seed=0, empty_row=False):
    """old, new log-probs, per-token advantages, a ragged mask (lengths 6, 4, 1, 3, 5), all [5, 6]."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(5, 6, generator=g) * 3
    new = (old + 0.5 * torch.randn(5, 6, generator=g)).requires_grad_(True)
    adv = torch.randn(5, 6, generator=g)
    lengths = torch.tensor([6, 4, 1, 3, 0 if empty_row else 5])
    mask = (torch.arange(6) < lengths[:, None]).float()
    return old, new, adv, mask


def _compare(ours, verl, ours_kwargs, verl_kwargs, empty_row=False, is_weights=None):
    old, new, adv, mask = _batch(empty_row=empty_row)
    loss, metrics = ours(old, new, adv, mask, CLIP_LOW, CLIP_HIGH, is_weights=is_weights, **ours_kwargs)
    ref, ref_metrics = verl(
        old,
        new,
        adv,
        mask,
        clip_ratio_low=CLIP_LOW,
        clip_ratio_high=CLIP_HIGH,
        rollout_is_weights=is_weights,
        **verl_kwargs,
    )
    torch.testing.assert_close(loss, ref, atol=1e-6, rtol=0)
    (grad,) = torch.autograd.grad(loss, new)
    (ref_grad,) = torch.autograd.grad(ref, new)
    torch.testing.assert_close(grad, ref_grad, atol=1e-6, rtol=0)
    assert set(metrics) == {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"}
    for k, v in ref_metrics.items():
        assert metrics[k].dim() == 0 and not metrics[k].requires_grad
        assert metrics[k].item() == pytest.approx(v, abs=1e-6), k
    return metrics


@pytest.mark.parametrize("mode", AGG_LOSS_MODES)
@pytest.mark.parametrize("ours,verl", OURS_AND_VERL, ids=["gspo", "cispo"])
def test_matches_verl_every_agg_mode(ours, verl, mode):
    metrics = _compare(ours, verl, {"agg_mode": mode}, {"loss_agg_mode": mode})
    assert 0 < metrics["pg_clipfrac"].item() < 1  # both clip branches are exercised


@pytest.mark.parametrize("mode", AGG_LOSS_MODES)
@pytest.mark.parametrize("ours,verl", OURS_AND_VERL, ids=["gspo", "cispo"])
def test_matches_verl_with_global_counts_and_is_weights(ours, verl, mode):
    # Our global_tokens / global_seqs are verl's batch_num_tokens / global_batch_size. With a fully masked
    # row our local seq-mean counts every row while verl's skips empty ones: equal once the count is given.
    is_weights = torch.rand(5, 6, generator=torch.Generator().manual_seed(1)) + 0.5
    _compare(
        ours,
        verl,
        {"agg_mode": mode, "global_tokens": 37, "global_seqs": 9},
        {"loss_agg_mode": mode, "batch_num_tokens": 37, "global_batch_size": 9},
        is_weights=is_weights,
    )
    _compare(
        ours,
        verl,
        {"agg_mode": mode, "global_seqs": 5},
        {"loss_agg_mode": mode, "global_batch_size": 5},
        empty_row=True,
    )


def test_gspo_matches_verl_past_the_log_ratio_clamp():
    old, new, adv, mask = _batch()
    new = (old.detach() + 12.0).requires_grad_(True)  # sequence log-ratio 12 > 10: clamped, no gradient
    adv = -adv.abs()  # A < 0: the unclipped (clamped) branch is the max
    loss, _ = gspo_policy_loss(old, new, adv, mask, CLIP_LOW, CLIP_HIGH)
    ref, _ = _verl_gspo(old, new, adv, mask, "token-mean", CLIP_LOW, CLIP_HIGH)
    torch.testing.assert_close(loss, ref, atol=1e-4, rtol=1e-6)  # values near e^10
    (grad,) = torch.autograd.grad(loss, new)
    assert torch.all(grad == 0)


def test_gspo_identical_policies_ratio_one():
    old, _, adv, mask = _batch()
    new = old.clone().requires_grad_(True)
    loss, metrics = gspo_policy_loss(old, new, adv, mask, CLIP_LOW, CLIP_HIGH)
    n = mask.sum()
    torch.testing.assert_close(loss, -(adv * mask).sum() / n)  # ratio 1: loss = -mean(A)
    assert metrics["pg_clipfrac"].item() == 0.0 and metrics["ppo_kl"].item() == 0.0
    (grad,) = torch.autograd.grad(loss, new)
    torch.testing.assert_close(grad, -adv * mask / n)  # d ratio / d logprob = ratio = 1


def test_cispo_gradient_only_through_logprob():
    old, new, adv, mask = _batch()
    old = old.requires_grad_(True)
    loss, metrics = cispo_policy_loss(old, new, adv, mask, CLIP_LOW, CLIP_HIGH)
    grad_new, grad_old = torch.autograd.grad(loss, [new, old], allow_unused=True)
    assert grad_old is None  # the clipped IS weight is a constant
    weight = (new - old).exp().clamp(1 - CLIP_LOW, 1 + CLIP_HIGH).detach()
    torch.testing.assert_close(grad_new, -weight * adv * mask / mask.sum())
    assert metrics["pg_clipfrac"].item() > 0  # the clip was active somewhere, and still a gradient there
    assert torch.all(grad_new[mask.bool() & (adv != 0)] != 0)


def test_registry():
    assert POLICY_LOSSES == ("vanilla", "gspo", "cispo")
    assert get_policy_loss("vanilla") is policy_loss
    assert get_policy_loss("gspo") is gspo_policy_loss and get_policy_loss("cispo") is cispo_policy_loss
    with pytest.raises(ValueError, match="vanilla.*gspo.*cispo"):
        get_policy_loss("grpo")


@pytest.mark.parametrize("name", POLICY_LOSSES)
def test_same_signature_and_positional_call(name):
    old, new, adv, mask = _batch()
    loss, metrics = get_policy_loss(name)(old, new, adv, mask, 0.2, 0.28, None, "seq-mean-token-mean", None, 20, 5)
    assert loss.dim() == 0 and loss.requires_grad
    assert set(metrics) == {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"}
