"""DAPO's soft overlong penalty against verl's DAPORewardManager formula."""

import pytest
import torch

from verl_ds.algos import overlong_penalty

pytestmark = pytest.mark.numerics  # asserts numbers: rerun with AVX2 kernels (launch/numerics_avx2.sh)


def _verl(valid_response_length, max_resp_len, overlong_buffer_len, overlong_penalty_factor):
    # verl/workers/reward_manager/dapo.py (0.9.1), per sample.
    expected_len = max_resp_len - overlong_buffer_len
    exceed_len = valid_response_length - expected_len
    return min(-exceed_len / overlong_buffer_len * overlong_penalty_factor, 0)


# (lengths, max_new_tokens, buffer_len, penalty, expected)
CASES = [
    ([0, 10, 12], 16, 4, 1.0, [0.0, 0.0, 0.0]),  # at or below max - buffer: no penalty
    ([13, 14, 15, 16], 16, 4, 1.0, [-0.25, -0.5, -0.75, -1.0]),  # linear to -penalty at max
    ([14, 16], 16, 4, 0.5, [-0.25, -0.5]),  # scaled by the penalty factor
    ([0, 1, 2, 4], 4, 4, 2.0, [0.0, -0.5, -1.0, -2.0]),  # buffer == max_new_tokens: from length 0
    ([3, 4], 4, 1, 1.0, [0.0, -1.0]),  # one-token buffer: only the truncated one
    ([4096, 3072, 3584], 4096, 1024, 1.0, [-1.0, 0.0, -0.5]),  # a 1k buffer at 4k tokens
    ([5, 100], 100, 0, 1.0, [0.0, 0.0]),  # buffer 0: disabled
    ([], 16, 4, 1.0, []),  # empty batch
]


@pytest.mark.parametrize("lengths,max_new,buf,pen,expected", CASES)
def test_overlong_penalty_table(lengths, max_new, buf, pen, expected):
    out = overlong_penalty(torch.tensor(lengths, dtype=torch.long), max_new, buf, pen)
    assert out.dtype == torch.float32 and out.shape == (len(lengths),)
    torch.testing.assert_close(out, torch.tensor(expected, dtype=torch.float32))
    if buf > 0:
        torch.testing.assert_close(
            out, torch.tensor([_verl(n, max_new, buf, pen) for n in lengths], dtype=torch.float32)
        )


def test_overlong_penalty_float_lengths_and_bad_buffer():
    torch.testing.assert_close(overlong_penalty(torch.tensor([14.0]), 16, 4, 1.0), torch.tensor([-0.5]))
    for buf in (-1, 17):
        with pytest.raises(ValueError):
            overlong_penalty(torch.tensor([1]), 16, buf, 1.0)
