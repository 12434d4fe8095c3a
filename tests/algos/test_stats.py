import math

import pytest
import torch

from verl_ds.algos import AGG_LOSS_MODES, agg_loss, masked_mean, masked_sum, masked_var, masked_whiten

pytestmark = pytest.mark.numerics  # asserts numbers: rerun with AVX2 kernels (launch/numerics_avx2.sh)

X = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
M = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


def test_masked_mean_hand():
    assert masked_mean(X, M).item() == pytest.approx(7 / 3)
    torch.testing.assert_close(masked_mean(X, M, dim=-1), torch.tensor([1.5, 4.0]))
    torch.testing.assert_close(masked_mean(X, M, dim=0), torch.tensor([2.5, 2.0, 0.0]))
    assert masked_sum(X, M).item() == 7.0


def test_masked_ignores_nonfinite_and_empty():
    x = X.clone()
    x[0, 2], x[1, 1] = float("nan"), float("inf")
    assert masked_mean(x, M).item() == pytest.approx(7 / 3)
    assert masked_mean(X, torch.zeros_like(M)).item() == 0.0


def test_masked_var_hand():
    # values 1, 2, 4: mean 7/3, squared deviations sum = 16/9 + 1/9 + 25/9 = 42/9
    assert masked_var(X, M, unbiased=False).item() == pytest.approx(42 / 27)
    assert masked_var(X, M).item() == pytest.approx(42 / 18)
    # one token: variance 0, no error
    assert masked_var(X, torch.tensor([[1.0, 0, 0], [0, 0, 0]])).item() == 0.0


def test_masked_whiten_hand():
    w = masked_whiten(X, M)
    std = math.sqrt(42 / 18 + 1e-8)
    expected = torch.tensor([[(1 - 7 / 3) / std, (2 - 7 / 3) / std, 0.0], [(4 - 7 / 3) / std, 0.0, 0.0]])
    torch.testing.assert_close(w, expected)
    torch.testing.assert_close(masked_whiten(X, M, shift_mean=False), (expected + 7 / 3) * M)


def test_agg_loss_hand():
    assert agg_loss(X, M, "token-mean").item() == pytest.approx(7 / 3)
    assert agg_loss(X, M, "seq-mean-token-sum").item() == pytest.approx(3.5)
    assert agg_loss(X, M, "seq-mean-token-mean").item() == pytest.approx(2.75)
    assert agg_loss(X, M, "seq-mean-token-sum-norm").item() == pytest.approx(7 / 6)
    with pytest.raises(ValueError, match="token-mean"):
        agg_loss(X, M, "bogus")


@pytest.mark.parametrize("mode", AGG_LOSS_MODES)
def test_agg_loss_microbatches_with_global_counts_equal_full_batch(mode):
    g = torch.Generator().manual_seed(0)
    loss = torch.randn(6, 5, generator=g)
    mask = (torch.rand(6, 5, generator=g) > 0.4).float()
    mask[:, 0] = 1.0
    full = agg_loss(loss, mask, mode)
    tokens, seqs = mask.sum(), loss.shape[0]
    # 2 micro-batches of unequal size, e.g. on 2 ranks or 2 accumulation steps
    parts = [
        agg_loss(loss[s], mask[s], mode, global_tokens=tokens, global_seqs=seqs) for s in (slice(0, 2), slice(2, 6))
    ]
    torch.testing.assert_close(sum(parts), full)
    # python-number counts work too
    parts = [
        agg_loss(loss[s], mask[s], mode, global_tokens=int(tokens), global_seqs=seqs)
        for s in (slice(0, 3), slice(3, 6))
    ]
    torch.testing.assert_close(sum(parts), full)


def test_agg_loss_gradient_ignores_masked():
    loss = X.clone().requires_grad_(True)
    agg_loss(loss, M, "token-mean").backward()
    torch.testing.assert_close(loss.grad, M / 3)


def test_pass_at_k_unbiased_estimator():
    from math import comb

    from verl_ds.algos import pass_at_k

    for n, c, k in [(8, 0, 8), (8, 1, 8), (8, 3, 2), (10, 5, 1), (5, 5, 3)]:
        want = 1.0 - comb(n - c, k) / comb(n, k)
        assert abs(pass_at_k(n, c, k) - want) < 1e-12
    assert pass_at_k(10, 5, 1) == 0.5
