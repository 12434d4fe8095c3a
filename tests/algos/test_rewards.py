import math

import pytest
import torch

from verl_ds.algos import RunningMeanStd, normalize_rewards

pytestmark = pytest.mark.numerics  # asserts numbers: rerun with AVX2 kernels (launch/numerics_avx2.sh)


def test_running_mean_std_hand_and_state():
    rms = RunningMeanStd()
    assert (rms.mean, rms.std) == (0.0, 1.0)
    rms.update(torch.tensor([1.0, 2.0, 3.0]))
    assert rms.mean == pytest.approx(2.0) and rms.var == pytest.approx(2 / 3)
    rms.update(torch.tensor([4.0, 5.0]))
    # same as the moments of 1..5
    assert rms.mean == pytest.approx(3.0) and rms.var == pytest.approx(2.0) and rms.count == 5
    state = rms.state_dict()
    assert all(type(v) is float for v in state.values())
    other = RunningMeanStd()
    other.load_state_dict(state)
    assert other.state_dict() == state


def test_normalize_batch_hand():
    out = normalize_rewards(torch.tensor([1.0, 2.0, 3.0]))
    s = math.sqrt(2 / 3)
    torch.testing.assert_close(out, torch.tensor([-1 / s, 0.0, 1 / s]))
    torch.testing.assert_close(
        normalize_rewards(torch.tensor([1.0, 2.0, 3.0]), clip=1.0), torch.tensor([-1.0, 0.0, 1.0])
    )
    assert normalize_rewards(torch.tensor([4.0])).item() == 0.0
    assert normalize_rewards(torch.tensor([1, 3])).dtype == torch.float32


def test_normalize_running_updates_first():
    rms = RunningMeanStd()
    out = normalize_rewards(torch.tensor([1.0, 3.0]), mode="running", stats=rms)
    torch.testing.assert_close(out, torch.tensor([-1.0, 1.0]))
    out = normalize_rewards(torch.tensor([5.0, 7.0]), mode="running", stats=rms)
    mean, std = 4.0, math.sqrt(5.0)  # moments of 1, 3, 5, 7
    torch.testing.assert_close(out, torch.tensor([(5 - mean) / std, (7 - mean) / std]))


def test_normalize_errors():
    with pytest.raises(ValueError):
        normalize_rewards(torch.ones(2), mode="running")
    with pytest.raises(ValueError):
        normalize_rewards(torch.ones(2), mode="ema")
