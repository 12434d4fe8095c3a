import math

import pytest
import torch

from verl_ds import algos
from verl_ds.algos import entropy_from_logits, logprobs_and_entropy, logprobs_from_logits, mismatch_metrics, tis_weights

pytestmark = pytest.mark.numerics  # asserts numbers: rerun with AVX2 kernels (launch/numerics_avx2.sh)


def test_logprobs_and_entropy_hand():
    logits = torch.log(torch.tensor([[1.0, 2.0, 3.0]]))  # probs 1/6, 1/3, 1/2
    lp = logprobs_from_logits(logits, torch.tensor([2]))
    assert lp.item() == pytest.approx(math.log(0.5))
    h = -(1 / 6 * math.log(1 / 6) + 1 / 3 * math.log(1 / 3) + 1 / 2 * math.log(1 / 2))
    assert entropy_from_logits(logits).item() == pytest.approx(h)
    assert entropy_from_logits(logits, chunk_size=1).item() == pytest.approx(h)
    assert entropy_from_logits(torch.zeros(4, 8)).allclose(torch.full((4,), math.log(8)))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("chunk_size", [None, 5])
def test_low_precision_logits_match_fp32_log_softmax(dtype, chunk_size):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 4, 50, generator=g) * 4).to(dtype)
    labels = torch.randint(0, 50, (3, 4), generator=g)
    ref_lp = torch.log_softmax(logits.float(), -1)
    lp = logprobs_from_logits(logits, labels, chunk_size=chunk_size)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, ref_lp.gather(-1, labels.unsqueeze(-1)).squeeze(-1))
    ent = entropy_from_logits(logits, chunk_size=chunk_size)
    assert ent.dtype == torch.float32
    torch.testing.assert_close(ent, -(ref_lp.exp() * ref_lp).sum(-1))


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 100])
def test_chunked_matches_unchunked_values_and_grads(chunk_size):
    g = torch.Generator().manual_seed(1)
    full = torch.randn(2, 6, 11, generator=g).to(torch.bfloat16)
    labels = torch.randint(0, 11, (2, 5), generator=g)
    upstream = torch.randn(2, 5, generator=g)
    results = []
    for cs in (None, chunk_size):
        x = full.clone().requires_grad_(True)
        logits = x[:, :-1]  # non-contiguous slice, as in a causal LM
        lp = logprobs_from_logits(logits, labels, chunk_size=cs)
        ent = entropy_from_logits(logits, chunk_size=cs)
        ((lp * upstream).sum() + (ent * upstream.flip(0)).sum()).backward()
        assert x.grad.dtype == torch.bfloat16
        results.append((lp.detach(), ent.detach(), x.grad.float()))
    (lp0, ent0, g0), (lp1, ent1, g1) = results
    torch.testing.assert_close(lp1, lp0)
    torch.testing.assert_close(ent1, ent0)
    torch.testing.assert_close(g1, g0, atol=1e-2, rtol=1.6e-2)  # bf16 gradients


def test_chunked_gradcheck_fp64():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 4, 5, dtype=torch.float64, generator=g).requires_grad_(True)
    labels = torch.randint(0, 5, (2, 3), generator=g)
    assert torch.autograd.gradcheck(lambda z: logprobs_from_logits(z[:, 1:], labels, chunk_size=2), (x,))
    assert torch.autograd.gradcheck(lambda z: entropy_from_logits(z[:, 1:], chunk_size=2), (x,))


def test_entropy_with_neg_inf_logits():
    logits = torch.tensor([[0.0, 0.0, float("-inf")]], requires_grad=True)
    for cs in (None, 1):
        ent = entropy_from_logits(logits, chunk_size=cs)
        assert ent.item() == pytest.approx(math.log(2))
        (grad,) = torch.autograd.grad(ent.sum(), logits)
        assert torch.isfinite(grad).all()


def test_tis_weights_hand():
    train = torch.zeros(2, 3)
    roll = torch.tensor([[-1.0, 0.0, 1.0], [0.5, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    tok = tis_weights(train, roll, mask, cap=2.0)
    torch.testing.assert_close(tok, torch.tensor([[2.0, 1.0, 0.0], [math.exp(-0.5), 0.0, 0.0]]))
    seq = tis_weights(train, roll, mask, cap=2.0, level="sequence")
    # seq 0: sum log-ratio = 1 + 0 -> e capped at 2; seq 1: -0.5
    torch.testing.assert_close(seq, torch.tensor([[2.0, 2.0, 0.0], [math.exp(-0.5), 0.0, 0.0]]))
    t = train.clone().requires_grad_(True)
    assert not tis_weights(t, roll, mask).requires_grad
    with pytest.raises(ValueError):
        tis_weights(train, roll, mask, level="geo")


def test_mismatch_metrics_hand():
    train = torch.log(torch.tensor([[0.5, 0.25, 0.9]]))
    roll = torch.log(torch.tensor([[0.25, 0.5, 0.1]]))
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    m = mismatch_metrics(train, roll, mask)
    assert set(m) == {
        "logprob_abs_diff_mean",
        "logprob_abs_diff_max",
        "k3_kl",
        "prob_pearson",
        "is_ess",
        "is_weight_mean",
        "is_weight_max",
    }
    assert m["logprob_abs_diff_mean"].item() == pytest.approx(math.log(2))
    assert m["logprob_abs_diff_max"].item() == pytest.approx(math.log(2))
    # k3 with r = p_train / p_roll: (2 - ln 2 - 1 + 0.5 + ln 2 - 1) / 2 = 0.25
    assert m["k3_kl"].item() == pytest.approx(0.25)
    assert m["prob_pearson"].item() == pytest.approx(-1.0)
    assert m["is_ess"].item() == pytest.approx(2.5**2 / (2 * 4.25))  # weights 2, 0.5 (the masked 9 left out)
    assert m["is_weight_mean"].item() == pytest.approx(1.25) and m["is_weight_max"].item() == pytest.approx(2.0)
    capped = mismatch_metrics(train, roll, mask, cap=1.5)
    assert capped["is_capped_fraction"].item() == pytest.approx(0.5)
    same = mismatch_metrics(train, train, torch.ones(1, 3))
    assert same["logprob_abs_diff_max"].item() == 0.0 and same["k3_kl"].item() == 0.0
    assert same["prob_pearson"].item() == pytest.approx(1.0)
    assert same["is_ess"].item() == pytest.approx(1.0)
    assert all(v.dim() == 0 for v in m.values())


def test_phantom_clip_fraction_counts_ratios_outside_the_clip_range():
    """Ratios exp(train - rollout) of 1.1, 1.3, 0.85, 0.7 (and a masked 5.0): with clip 0.2/0.2 the
    1.3 and the 0.7 are clipped (2 of 4); with clip_high 0.28 (DAPO) still both; with clip_low 0.35
    only the 1.3. The row's sequence ratio (the geometric mean, ~0.96) is inside every band."""
    roll = torch.zeros(1, 5)
    train = torch.log(torch.tensor([[1.1, 1.3, 0.85, 0.7, 5.0]]))
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])

    def dist(**kw):
        return algos.ratio_distribution(*algos.log_ratios(train, roll, mask), **kw)

    assert dist()["phantom_clip_fraction"] == pytest.approx(0.5)
    assert dist(clip_high=0.28)["phantom_clip_fraction"] == pytest.approx(0.5)
    assert dist(clip_low=0.35)["phantom_clip_fraction"] == pytest.approx(0.25)
    assert dist()["seq_phantom_clip_fraction"] == 0.0


def test_ratio_distribution_reports_the_tail_the_mean_hides():
    """99 tokens at |log ratio| 1e-3 and one at 0.5, and a second row of 50 at 0.4: the median sees
    none of it, the p99 and max do; the second row's sequence ratio is outside the band, the first's not."""
    train = torch.full((2, 100), 1e-3)
    train[0, 7] = 0.5
    train[1] = -0.4
    mask = torch.ones(2, 100)
    mask[1, 50:] = 0
    tokens, seqs = algos.log_ratios(train, torch.zeros(2, 100), mask)
    assert tokens.shape == (150,) and seqs.shape == (2,)
    d = algos.ratio_distribution(tokens, seqs)
    assert d["log_ratio_abs_p50"] == pytest.approx(1e-3)
    assert d["log_ratio_abs_max"] == pytest.approx(0.5)
    assert d["log_ratio_abs_p99"] == pytest.approx(0.4)
    assert d["phantom_clip_fraction"] == pytest.approx(51 / 150)
    assert d["seq_phantom_clip_fraction"] == pytest.approx(0.5)
    assert d["seq_log_ratio_abs_max"] == pytest.approx(0.4)
    assert set(algos.ratio_distribution(tokens[:0], seqs[:0]).values()) == {0.0}


def test_the_gate_bound_follows_the_coarser_dtype():
    assert algos.mismatch_gate_bound("fp32", "fp32") == 0.01
    assert algos.mismatch_gate_bound("fp32", "bf16") == algos.mismatch_gate_bound("bf16", "fp32") == 0.05
    assert algos.mismatch_gate_bound("fp16", "fp32") == 0.03


def test_chunked_sliced_logits_take_few_blocks_not_one_per_sequence():
    # logits[:, :-1] of 64 short sequences fit in one 1024-row chunk: one log-softmax, not 64
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += func is torch.ops.aten._log_softmax.default
            return func(*args, **(kwargs or {}))

    x = torch.randn(64, 9, 20)
    labels = torch.randint(0, 20, (64, 8))
    with Count():
        lp = logprobs_from_logits(x[:, :-1], labels, chunk_size=1024)
    assert Count.n == 1
    torch.testing.assert_close(lp, logprobs_from_logits(x[:, :-1], labels))


@pytest.mark.parametrize("chunk_size", [1, 4, 1024])
def test_logprobs_and_entropy_in_one_pass_equal_the_separate_ones(chunk_size):
    g = torch.Generator().manual_seed(3)
    full = torch.randn(3, 6, 13, generator=g)
    full[0, 0, 5] = float("-inf")  # a masked token: entropy stays finite
    labels = torch.randint(0, 13, (3, 5), generator=g)
    labels[0, 0] = 0
    x = full.clone().requires_grad_(True)
    lp, ent = logprobs_and_entropy(x[:, :-1], labels, chunk_size=chunk_size)
    assert not ent.requires_grad and torch.isfinite(ent).all()
    torch.testing.assert_close(ent, entropy_from_logits(full[:, :-1]))
    upstream = torch.randn(3, 5, generator=g)
    (lp * upstream).sum().backward()
    y = full.clone().requires_grad_(True)
    ref = logprobs_from_logits(y[:, :-1], labels)
    (ref * upstream).sum().backward()
    torch.testing.assert_close(lp.detach(), ref.detach())
    torch.testing.assert_close(x.grad, y.grad)


# ---------------------------------------------------------------- the sampled (truncated) distribution
def test_top_p_keeps_the_nucleus_and_top_k_the_k_most_likely():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    lp = algos.processed_logprobs(logits, algos.TokenDist(1.0, 0, 0.7))
    assert torch.isinf(lp[0, 2:]).all() and torch.allclose(lp[0, :2].exp().sum(), torch.tensor(1.0))
    lp = algos.processed_logprobs(logits, algos.TokenDist(1.0, 3, 1.0))
    assert torch.isinf(lp[0, 3]) and torch.isfinite(lp[0, :3]).all()
    # top-p over the top-k's renormalised mass: 0.5 / 0.8 = 0.625 reaches 0.6 alone, not 0.7
    lp = algos.processed_logprobs(logits, algos.TokenDist(1.0, 2, 0.6))
    assert torch.isfinite(lp[0, 0]) and torch.isinf(lp[0, 1:]).all()
    lp = algos.processed_logprobs(logits, algos.TokenDist(1.0, 2, 0.7))
    assert torch.isfinite(lp[0, :2]).all() and torch.isinf(lp[0, 2:]).all()
    assert not algos.TokenDist(0.0, 5, 0.5).truncates  # greedy: the raw distribution


@pytest.mark.parametrize("top_k,top_p", [(0, 0.8), (20, 1.0), (20, 0.9), (3, 0.5)])
def test_kept_tokens_are_the_set_vllms_sampler_keeps(top_k, top_p):
    """The engine's own rule, not a lookalike: vLLM's PyTorch top-k/top-p op on the same logits."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    x = torch.randn(64, 500, generator=torch.Generator().manual_seed(top_k)) * 3
    k = torch.full((64,), top_k) if top_k else None
    p = torch.full((64,), top_p) if top_p < 1 else None
    want = torch.isfinite(apply_top_k_top_p_pytorch(x.clone(), k, p))
    assert torch.equal(algos.kept_tokens(x, top_k, top_p), want)


@pytest.mark.parametrize("chunk_size", [None, 7])
def test_truncated_logprobs_values_and_grads_equal_the_masked_softmax(chunk_size):
    """Under a `TokenDist`, logprob and entropy are the renormalised kept set's (temperature in fp32),
    a label the set would cut stays kept, and the gradients are the masked softmax's (0 outside it)."""
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(2, 9, 40, generator=g) * 2).requires_grad_()
    labels = torch.randint(0, 40, (2, 9), generator=g)
    labels[0, 0] = int(logits[0, 0].argmin())  # the least likely token: outside any nucleus
    dist = algos.TokenDist(0.7, 12, 0.8)
    lp = algos.logprobs_from_logits(logits, labels, chunk_size, dist)
    ent = algos.entropy_from_logits(logits, chunk_size, dist, labels)
    x = logits.detach().double() / 0.7
    keep = algos.kept_tokens(x.view(-1, 40), 12, 0.8).view(x.shape)
    keep.scatter_(-1, labels.unsqueeze(-1), True)
    ref_logits = logits.double()
    xr = (ref_logits / 0.7).masked_fill(~keep, float("-inf"))
    want_lp = torch.log_softmax(xr, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    want_ent = algos.entropy_from_logits(xr)
    assert torch.isfinite(lp).all() and keep.sum(-1).lt(40).all()  # truncated, never -inf
    torch.testing.assert_close(lp.double(), want_lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent.double(), want_ent, rtol=0, atol=1e-5)
    (got,) = torch.autograd.grad((lp * 1.3).sum() + ent.sum(), logits)
    (want,) = torch.autograd.grad((want_lp * 1.3).sum() + want_ent.sum(), ref_logits)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)
    assert (got[~keep] == 0).all()
    lp2, ent2 = algos.logprobs_and_entropy(logits, labels, 5, dist)
    torch.testing.assert_close(lp2, lp.detach(), rtol=0, atol=1e-6)
    torch.testing.assert_close(ent2, ent.detach(), rtol=0, atol=1e-6)


def test_the_full_distribution_path_is_unchanged_by_the_token_dist():
    """T = 1 untruncated is the fused path, bit for bit (the matched pairs' 0.0 gaps rest on it)."""
    logits = torch.randn(3, 5, 30, generator=torch.Generator().manual_seed(1)).bfloat16()
    labels = torch.randint(0, 30, (3, 5))
    a = algos.logprobs_from_logits(logits, labels, 4)
    b = algos.logprobs_from_logits(logits, labels, 4, algos.TokenDist(1.0, 0, 1.0))
    assert torch.equal(a, b)
