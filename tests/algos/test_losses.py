import math

import pytest
import torch

from verl_ds.algos import AdaptiveKLController, FixedKLController, kl_penalty, policy_loss, value_loss

pytestmark = pytest.mark.numerics  # asserts numbers: rerun with AVX2 kernels (launch/numerics_avx2.sh)


def test_kl_penalty_hand():
    lp, ref = torch.tensor([-1.0]), torch.tensor([-2.0])
    assert kl_penalty(lp, ref, "k1").item() == pytest.approx(1.0)
    assert kl_penalty(lp, ref, "k2").item() == pytest.approx(0.5)
    assert kl_penalty(lp, ref, "abs").item() == pytest.approx(1.0)
    assert kl_penalty(ref, lp, "abs").item() == pytest.approx(1.0)
    # k3: exp(-1) - (-1) - 1
    assert kl_penalty(lp, ref, "k3").item() == pytest.approx(math.exp(-1))
    assert kl_penalty(lp, ref, "low_var_kl").item() == pytest.approx(math.exp(-1))
    assert kl_penalty(ref, lp, "k3").item() == pytest.approx(math.e - 2)


def test_kl_penalty_clamps():
    lp, ref = torch.tensor([0.0, -100.0]), torch.tensor([-100.0, 0.0])
    torch.testing.assert_close(kl_penalty(lp, ref, "k1"), torch.tensor([100.0, -100.0]))  # unclamped
    # log-ratio clamped to -20 -> exp(-20) + 19 -> 10; +20 -> exp(20) - 21 -> 10
    torch.testing.assert_close(kl_penalty(lp, ref, "k3"), torch.tensor([10.0, 10.0]))
    assert (kl_penalty(torch.tensor([0.0]), torch.tensor([-9.0]), "k3") < 10).all()
    with pytest.raises(ValueError):
        kl_penalty(lp, ref, "k4")


def test_policy_loss_hand_clipped():
    old = torch.zeros(1, 2)
    new = torch.log(torch.tensor([[1.5, 0.5]]))
    adv = torch.tensor([[1.0, -1.0]])
    loss, m = policy_loss(old, new, adv, torch.ones(1, 2))
    # token 0: max(-1.5, -1.2) = -1.2; token 1: max(.5, .8) = .8
    assert loss.item() == pytest.approx(-0.2)
    assert m["pg_clipfrac"].item() == 1.0 and m["pg_clipfrac_lower"].item() == 0.0
    assert m["ppo_kl"].item() == pytest.approx(-math.log(0.75) / 2)
    assert all(v.dim() == 0 and not v.requires_grad for v in m.values())


def test_policy_loss_unclipped_gradient_and_asymmetric_clip():
    new = torch.log(torch.tensor([[1.1, 1.25]])).requires_grad_(True)
    loss, m = policy_loss(torch.zeros(1, 2), new, torch.tensor([[1.0, 1.0]]), torch.ones(1, 2), clip_high=0.28)
    assert loss.item() == pytest.approx(-(1.1 + 1.25) / 2)
    assert m["pg_clipfrac"].item() == 0.0
    loss.backward()
    # d(-A * exp(lp))/dlp / 2 tokens
    torch.testing.assert_close(new.grad, torch.tensor([[-1.1 / 2, -1.25 / 2]]))
    new2 = torch.log(torch.tensor([[1.3]])).requires_grad_(True)
    loss, m = policy_loss(torch.zeros(1, 1), new2, torch.ones(1, 1), torch.ones(1, 1), clip_high=0.28)
    loss.backward()
    assert loss.item() == pytest.approx(-1.28) and new2.grad.item() == 0.0 and m["pg_clipfrac"].item() == 1.0


def test_policy_loss_dual_clip_hand():
    old = torch.zeros(1, 3)
    new = torch.log(torch.tensor([[5.0, 5.0, 2.0]]))
    adv = torch.tensor([[-1.0, 1.0, -1.0]])
    loss, m = policy_loss(old, new, adv, torch.ones(1, 3), dual_clip_c=3.0)
    # tok0: max(5, 1.2) = 5 -> min(5, 3) = 3 (dual clip); tok1 (A>0): max(-5, -1.2) = -1.2; tok2: max(2, 1.2) = 2 < 3
    assert loss.item() == pytest.approx((3.0 - 1.2 + 2.0) / 3)
    assert m["pg_clipfrac_lower"].item() == pytest.approx(1 / 3)
    assert m["pg_clipfrac"].item() == pytest.approx(1 / 3)
    loss_nodual, _ = policy_loss(old, new, adv, torch.ones(1, 3))
    assert loss_nodual.item() == pytest.approx((5.0 - 1.2 + 2.0) / 3)
    with pytest.raises(ValueError):
        policy_loss(old, new, adv, torch.ones(1, 3), dual_clip_c=1.0)


def test_policy_loss_identical_logprobs():
    g = torch.Generator().manual_seed(0)
    lp = torch.randn(3, 4, generator=g)
    adv = torch.randn(3, 4, generator=g)
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0]])
    loss, m = policy_loss(lp, lp.clone(), adv, mask, dual_clip_c=3.0)
    # ratio 1: loss = -masked mean of A
    torch.testing.assert_close(loss, -(adv * mask).sum() / mask.sum())
    assert m["pg_clipfrac"].item() == 0.0 and m["pg_clipfrac_lower"].item() == 0.0 and m["ppo_kl"].item() == 0.0


def test_policy_loss_is_weights_mask_and_global_counts():
    old, new = torch.zeros(2, 2), torch.zeros(2, 2)
    adv = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    w = torch.tensor([[0.5, 2.0], [1.0, 0.0]])
    loss, _ = policy_loss(old, new, adv, mask, is_weights=w)
    assert loss.item() == pytest.approx(-(0.5 + 4.0 + 3.0) / 3)
    loss, _ = policy_loss(old, new, adv, mask, agg_mode="seq-mean-token-sum", global_seqs=4)
    assert loss.item() == pytest.approx(-(3.0 + 3.0) / 4)
    loss, _ = policy_loss(old, new, adv, mask, global_tokens=6)
    assert loss.item() == pytest.approx(-6.0 / 6)


def test_value_loss_hand():
    loss, m = value_loss(torch.tensor([[1.0, 0.0]]), torch.zeros(1, 2), torch.tensor([[2.0, 0.2]]), torch.ones(1, 2))
    # tok0: max(1, (0.5 - 2)^2 = 2.25) clipped; tok1: 0.04 both
    assert loss.item() == pytest.approx(0.5 * (2.25 + 0.04) / 2)
    assert m["vf_clipfrac"].item() == pytest.approx(0.5)
    loss, m = value_loss(
        torch.tensor([[1.0, 0.0]]), torch.zeros(1, 2), torch.tensor([[2.0, 0.2]]), torch.ones(1, 2), clip=None
    )
    assert loss.item() == pytest.approx(0.5 * (1.0 + 0.04) / 2) and m["vf_clipfrac"].item() == 0.0
    loss, _ = value_loss(
        torch.tensor([[1.0, 0.0]]),
        torch.zeros(1, 2),
        torch.tensor([[2.0, 0.2]]),
        torch.ones(1, 2),
        agg_mode="seq-mean-token-sum",
        global_seqs=2,
    )
    assert loss.item() == pytest.approx(0.5 * (2.25 + 0.04) / 2)


def test_kl_controllers():
    fixed = FixedKLController(0.05)
    fixed.update(100.0, 256)
    assert fixed.value == 0.05 and fixed.state_dict() == {"value": 0.05}
    ctl = AdaptiveKLController(init=0.1, target=6.0, horizon=10000)
    ctl.update(9.0, 256)  # error clipped to +0.2
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 256 / 10000))
    ctl.update(torch.tensor(3.0), 256)  # error clipped to -0.2
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 256 / 10000) * (1 - 0.2 * 256 / 10000))
    v = ctl.value
    ctl.update(6.3, 100)  # error 0.05
    assert ctl.value == pytest.approx(v * (1 + 0.05 * 100 / 10000))
    other = AdaptiveKLController(init=1.0, target=6.0, horizon=10000)
    other.load_state_dict(ctl.state_dict())
    assert other.value == ctl.value and type(ctl.state_dict()["value"]) is float


def _areal_decoupled_loss(logprobs, proximal, behave, adv, mask, eps, cap):
    """AReaL's `ppo_actor_loss_fn` (decoupled PPO), as its formula reads: the clip on pi/pi_prox,
    times the behaviour weight pi_prox/pi_behave, zeroed where it exceeds the cap; the mean over the
    loss mask's tokens."""
    ratio = torch.exp(logprobs - proximal)
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps, 1 + eps))
    w = torch.exp(proximal - behave)
    w = torch.where((w <= cap) & mask.bool(), w, torch.zeros_like(w))
    return torch.where(mask.bool(), pg * w, torch.zeros_like(pg)).sum() / mask.count_nonzero()


def test_decoupled_ppo_matches_areals_formula_and_hand_values():
    from verl_ds.algos import tis_weights

    proximal = torch.zeros(1, 4)
    logprobs = torch.log(torch.tensor([[1.5, 0.5, 1.0, 1.1]]))
    behave = torch.log(torch.tensor([[0.5, 1.0, 0.25, 1.0]]))  # weights pi_prox/pi_behave: 2, 1, 4, 1
    adv = torch.tensor([[1.0, -1.0, 1.0, 2.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    w = tis_weights(proximal, behave, mask, cap=3.0, mode="mask")
    torch.testing.assert_close(w, torch.tensor([[2.0, 1.0, 0.0, 0.0]]))  # 4 > cap: the token drops out
    loss, _ = policy_loss(proximal, logprobs, adv, mask, clip_low=0.2, clip_high=0.2, is_weights=w)
    # token 0: max(-1.5, -1.2) * 2 = -2.4; token 1: max(0.5, 0.8) * 1 = 0.8; token 2: 0; over 3 tokens
    assert loss.item() == pytest.approx((-2.4 + 0.8) / 3)
    assert loss.item() == pytest.approx(_areal_decoupled_loss(logprobs, proximal, behave, adv, mask, 0.2, 3.0).item())
    truncated = tis_weights(proximal, behave, mask, cap=3.0)  # TIS keeps the token at the cap
    torch.testing.assert_close(truncated, torch.tensor([[2.0, 1.0, 3.0, 0.0]]))
    # a planted bug: the behaviour weight left uncapped changes the loss
    uncapped = tis_weights(proximal, behave, mask, cap=1e9)
    assert policy_loss(proximal, logprobs, adv, mask, is_weights=uncapped)[0].item() != pytest.approx(loss.item())
    with pytest.raises(ValueError):
        tis_weights(proximal, behave, mask, mode="clip")
