"""Property-based checks (hypothesis) of the invariants of verl_ds.algos."""

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from verl_ds.algos import (  # noqa: E402
    AGG_LOSS_MODES,
    agg_loss,
    compute_gae,
    grpo_advantages,
    kl_penalty,
    logprobs_from_logits,
    rloo_advantages,
)

pytestmark = pytest.mark.numerics  # asserts numbers: rerun with AVX2 kernels (launch/numerics_avx2.sh)

SETTINGS = settings(max_examples=25, deadline=None)


def _batch(seed, b, t):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(b, t, generator=g) > 0.3).float()
    return g, mask


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), b=st.integers(1, 4), t=st.integers(1, 6), gamma=st.floats(0, 1))
def test_gae_lam1_zero_values_equals_discounted_return(seed, b, t, gamma):
    g, mask = _batch(seed, b, t)
    r = torch.randn(b, t, generator=g, dtype=torch.float64)
    adv, ret = compute_gae(r, torch.zeros(b, t, dtype=torch.float64), mask, gamma, 1.0)
    expected = torch.zeros_like(r)
    for i in range(b):
        running = 0.0
        for j in reversed(range(t)):
            if mask[i, j]:
                running = r[i, j].item() + gamma * running
                expected[i, j] = running
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, expected)


@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    b=st.integers(1, 6),
    t=st.integers(1, 5),
    split=st.integers(0, 6),
    mode=st.sampled_from(AGG_LOSS_MODES),
)
def test_agg_loss_split_sums_to_full(seed, b, t, split, mode):
    g, mask = _batch(seed, b, t)
    loss = torch.randn(b, t, generator=g, dtype=torch.float64)
    split = min(split, b)
    kw = dict(global_tokens=mask.sum(), global_seqs=b)
    total = agg_loss(loss[:split], mask[:split], mode, **kw) + agg_loss(loss[split:], mask[split:], mode, **kw)
    torch.testing.assert_close(total, agg_loss(loss, mask, mode).to(total.dtype))


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 10), groups=st.integers(1, 4))
def test_group_advantages_are_zero_mean_per_group(seed, n, groups):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(n, generator=g, dtype=torch.float64)
    ids = torch.randint(0, groups, (n,), generator=g)
    mask = torch.ones(n, 1, dtype=torch.float64)
    for adv in (grpo_advantages(scores, ids, mask)[:, 0], rloo_advantages(scores, ids, mask)[:, 0]):
        for gid in ids.unique():
            sel = ids == gid
            assert abs(adv[sel].sum().item()) < 1e-9
            if sel.sum() == 1:
                assert adv[sel].item() == 0.0


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1))
def test_k3_nonnegative_and_zero_iff_equal(seed):
    g = torch.Generator().manual_seed(seed)
    lp, ref = torch.randn(2, 8, generator=g) * 5, torch.randn(2, 8, generator=g) * 5
    k3 = kl_penalty(lp, ref, "k3")
    assert (k3 >= 0).all() and (k3 <= 10).all()
    assert (kl_penalty(lp, lp, "k3") == 0).all() and (kl_penalty(lp, lp, "k2") == 0).all()


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 9), vocab=st.integers(1, 13), chunk=st.integers(1, 10))
def test_chunked_logprobs_agree(seed, rows, vocab, chunk):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 3
    labels = torch.randint(0, vocab, (rows,), generator=g)
    torch.testing.assert_close(
        logprobs_from_logits(logits, labels, chunk_size=chunk), logprobs_from_logits(logits, labels)
    )
