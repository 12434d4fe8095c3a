"""Distillation math: the per-token reverse KL and the dense-reward advantages."""

import torch

from verl_ds import algos


def test_reverse_kl_is_the_masked_log_ratio_and_zero_for_the_same_policy():
    s = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, -1.0]])
    t = torch.tensor([[-1.5, -1.0, -0.5], [-0.2, -2.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    assert torch.equal(algos.reverse_kl(s, t, mask), torch.tensor([[0.5, -1.0, 0.0], [0.1, -1.0, 8.0]]) * mask)
    assert torch.count_nonzero(algos.reverse_kl(s, s.clone(), mask)) == 0


def test_distill_advantages_discount_zero_is_each_tokens_own_reward():
    s = torch.tensor([[-1.0, -2.0, -0.5, -4.0]])
    t = torch.tensor([[-2.0, -1.0, -0.5, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    adv = algos.distill_advantages(s, t, mask, coef=2.0)
    assert torch.equal(adv, torch.tensor([[-2.0, 2.0, 0.0, 0.0]]))  # -coef * (s - t); masked: 0


def test_distill_advantages_discount_sums_later_rewards_skipping_masked_tokens():
    """An environment token (mask 0) between two model tokens neither counts nor breaks the sum."""
    s = torch.tensor([[-1.0, -9.0, -1.0]])
    t = torch.tensor([[-2.0, 0.0, -3.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    adv = algos.distill_advantages(s, t, mask, coef=1.0, discount=0.5)
    # rewards: token 0: -1, token 2: -2; G_2 = -2, G_0 = -1 + 0.5 * -2
    assert torch.allclose(adv, torch.tensor([[-2.0, 0.0, -2.0]]))


def test_discounted_returns_match_reinforce_pp_before_whitening():
    torch.manual_seed(0)
    r, mask = torch.randn(3, 6), (torch.rand(3, 6) > 0.3).float()
    g = algos.discounted_returns(r, mask, 0.9)
    assert torch.allclose(algos.reinforce_pp_advantages(r, mask, 0.9), algos.masked_whiten(g, mask))
    assert torch.count_nonzero(g * (1 - mask)) == 0
