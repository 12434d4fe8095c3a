import math

import pytest
import torch

from verl_ds.algos import (
    ADVANTAGE_ESTIMATORS,
    ESTIMATORS_NEEDING_CRITIC,
    compute_gae,
    get_advantage_estimator,
    grpo_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)

pytestmark = pytest.mark.numerics  # asserts numbers: rerun with AVX2 kernels (launch/numerics_avx2.sh)


def test_gae_hand():
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 0.4, 0.3]])
    adv, ret = compute_gae(r, v, torch.ones(1, 3), gamma=0.9, lam=0.8)
    # A2 = 1 - .3 = .7; A1 = (.9*.3 - .4) + .72*.7 = .374; A0 = (.9*.4 - .5) + .72*.374 = .12928
    torch.testing.assert_close(adv, torch.tensor([[0.12928, 0.374, 0.7]]))
    torch.testing.assert_close(ret, adv + v)


def test_gae_skips_masked_positions_hand():
    # the middle token is an observation token: next value and running GAE carry over it
    r = torch.tensor([[0.0, 5.0, 1.0]])
    v = torch.tensor([[0.5, 99.0, 0.3]])
    adv, ret = compute_gae(r, v, torch.tensor([[1.0, 0.0, 1.0]]), gamma=0.9, lam=0.8)
    # A0 = (.9*.3 - .5) + .72*.7 = .274
    torch.testing.assert_close(adv, torch.tensor([[0.274, 0.0, 0.7]]))
    torch.testing.assert_close(ret, torch.tensor([[0.774, 0.0, 1.0]]))


def test_gae_masked_values_and_rewards_do_not_matter():
    g = torch.Generator().manual_seed(1)
    r, v = torch.randn(4, 7, generator=g), torch.randn(4, 7, generator=g)
    mask = (torch.rand(4, 7, generator=g) > 0.3).float()
    mask[:, -2:] = 0.0  # trailing padding
    adv, ret = compute_gae(r, v, mask, 0.99, 0.95)
    r2 = torch.where(mask.bool(), r, torch.randn(4, 7, generator=g) * 100)
    v2 = torch.where(mask.bool(), v, torch.full_like(v, float("inf")))
    adv2, ret2 = compute_gae(r2, v2, mask, 0.99, 0.95)
    torch.testing.assert_close(adv2, adv)
    torch.testing.assert_close(ret2, ret)
    assert (adv[mask == 0] == 0).all() and (ret[mask == 0] == 0).all()


def test_gae_lam1_is_discounted_return_minus_value():
    r = torch.tensor([[1.0, 2.0, 3.0]])
    v = torch.tensor([[0.1, 0.2, 0.3]])
    adv, ret = compute_gae(r, v, torch.ones(1, 3), gamma=0.5, lam=1.0)
    torch.testing.assert_close(ret, torch.tensor([[1 + 0.5 * 2 + 0.25 * 3, 2 + 0.5 * 3, 3.0]]))


SCORES = torch.tensor([1.0, 0.0, 2.0, 5.0])
GROUPS = torch.tensor([0, 0, 0, 1])
MASK = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0]])


def test_grpo_hand_and_singleton():
    # group 0: mean 1, unbiased std 1; group 1 is a singleton -> 0
    adv = grpo_advantages(SCORES, GROUPS, MASK)
    torch.testing.assert_close(adv, torch.tensor([0.0, -1 / (1 + 1e-6), 1 / (1 + 1e-6), 0.0]).unsqueeze(-1) * MASK)
    dr = grpo_advantages(SCORES, GROUPS, MASK, norm_by_std=False)
    torch.testing.assert_close(dr, torch.tensor([0.0, -1.0, 1.0, 0.0]).unsqueeze(-1) * MASK)


def test_grpo_unsorted_group_ids_and_int_scores():
    adv = grpo_advantages(torch.tensor([3, 10, 1, 10]), torch.tensor([7, 3, 7, 3]), torch.ones(4, 1))
    torch.testing.assert_close(adv[:, 0], torch.tensor([1.0, 0.0, -1.0, 0.0]) / (math.sqrt(2) + 1e-6))


def test_rloo_hand():
    # s_i - mean(others): 1 - 1, 0 - 1.5, 2 - .5; singleton -> 0
    adv = rloo_advantages(SCORES, GROUPS, MASK)
    torch.testing.assert_close(adv, torch.tensor([0.0, -1.5, 1.5, 0.0]).unsqueeze(-1) * MASK)


def test_reinforce_pp_hand():
    adv = reinforce_pp_advantages(torch.tensor([[0.0, 0.0, 1.0]]), torch.ones(1, 3), gamma=0.5)
    g = [0.25, 0.5, 1.0]
    mean = sum(g) / 3
    std = math.sqrt(sum((x - mean) ** 2 for x in g) / 2 + 1e-8)
    torch.testing.assert_close(adv, torch.tensor([[(x - mean) / std for x in g]]))


def test_reinforce_pp_skips_masked():
    mask = torch.tensor([[1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    r = torch.tensor([[0.0, 9.0, 1.0, 9.0], [0.0, 2.0, 9.0, 9.0]])
    adv = reinforce_pp_advantages(r, mask, gamma=0.5)
    # returns over kept tokens: [.5, 1] and [1, 2]; mean 1.125
    g = [0.5, 1.0, 1.0, 2.0]
    mean = sum(g) / 4
    std = math.sqrt(sum((x - mean) ** 2 for x in g) / 3 + 1e-8)
    expected = torch.tensor([[g[0], 0, g[1], 0], [g[2], g[3], 0, 0]])
    torch.testing.assert_close(adv, torch.where(mask.bool(), (expected - mean) / std, 0.0))


def test_reinforce_pp_baseline_hand():
    mask = torch.ones(4, 1)
    adv = reinforce_pp_baseline_advantages(SCORES, GROUPS, mask)
    c = [0.0, -1.0, 1.0, 0.0]  # group-centered; singleton -> 0
    std = math.sqrt(sum(x * x for x in c) / 3 + 1e-8)
    torch.testing.assert_close(adv[:, 0], torch.tensor(c) / std)


_ZEROS = object()  # the default: critic values of zeros (None means "no critic")


def _call(name, values=_ZEROS):
    values = torch.zeros(2, 2) if values is _ZEROS else values
    return get_advantage_estimator(name)(
        token_rewards=torch.tensor([[0.0, 1.0], [0.0, 3.0]]),
        scores=torch.tensor([1.0, 3.0]),
        values=values,
        response_mask=torch.ones(2, 2),
        group_ids=torch.tensor([4, 4]),
        gamma=1.0,
        lam=1.0,
    )


@pytest.mark.parametrize("name", ADVANTAGE_ESTIMATORS)
def test_registry_uniform_signature(name):
    adv, ret = _call(name, values=torch.zeros(2, 2) if name in ESTIMATORS_NEEDING_CRITIC else None)
    assert adv.shape == ret.shape == (2, 2)
    if name not in ESTIMATORS_NEEDING_CRITIC:
        assert ret is adv
    assert (adv[0] < 0).all() and (adv[1] > 0).all() or name == "gae"


def test_registry_values():
    torch.testing.assert_close(_call("gae")[1], torch.tensor([[1.0, 1.0], [3.0, 3.0]]))
    torch.testing.assert_close(_call("dr_grpo")[0], torch.tensor([[-1.0, -1.0], [1.0, 1.0]]))
    torch.testing.assert_close(_call("rloo")[0], torch.tensor([[-2.0, -2.0], [2.0, 2.0]]))
    torch.testing.assert_close(
        _call("grpo")[0], grpo_advantages(torch.tensor([1.0, 3.0]), torch.tensor([0, 0]), torch.ones(2, 2))
    )


def test_registry_errors():
    assert ESTIMATORS_NEEDING_CRITIC == {"gae"}
    with pytest.raises(ValueError, match="reinforce_pp_baseline"):
        get_advantage_estimator("ppo")
    with pytest.raises(ValueError, match="values"):
        _call("gae", values=None)
