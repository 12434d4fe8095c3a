"""`verl_ds.data.reward.normalize_reward`: the one normalisation of scores, for a user's own pipeline
and for the loop's `algorithm.reward_normalization` (the trainer's `Rewards.normalize` calls it)."""

import pytest
import torch

from verl_ds import algos
from verl_ds.config import load_config
from verl_ds.data.reward import normalize_reward
from verl_ds.trainer.rewards import Rewards


def test_batch_mode_standardises_a_list_of_scores_and_clips():
    out = normalize_reward([0.0, 1.0, 1.0, 2.0], "batch")
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.tensor([-1.0, 0.0, 0.0, 1.0]) * 2**0.5, rtol=0, atol=1e-6)
    torch.testing.assert_close(normalize_reward([0.0, 1.0, 1.0, 2.0], "batch", clip=1.0), torch.tensor([-1.0, 0, 0, 1]))
    assert normalize_reward([3.0], "batch").item() == 0.0  # one sample: no spread, 0


def test_running_mode_updates_its_statistics_first_and_none_only_clips():
    stats = algos.RunningMeanStd()
    normalize_reward(torch.tensor([0.0, 2.0]), "running", stats=stats)
    assert stats.mean == pytest.approx(1.0)
    out = normalize_reward(torch.tensor([1.0, 1.0]), "running", stats=stats)
    assert stats.mean == pytest.approx(1.0) and torch.all(out.abs() < 1e-6)  # the mean of all four
    torch.testing.assert_close(normalize_reward([-5.0, 0.5, 5.0], "none", clip=2.0), torch.tensor([-2.0, 0.5, 2.0]))
    assert normalize_reward([-5.0, 5.0], "none").tolist() == [-5.0, 5.0]


@pytest.mark.parametrize("mode", ["batch", "running"])
def test_the_trainer_normalises_with_the_same_function(mode):
    cfg = load_config(None, [f"algorithm.reward_normalization={mode}", "algorithm.reward_clip=1.5"], world_size=1)
    rewards = Rewards(cfg, reward_fn=None, reward_model=None, tokenizer=None, rank=0)
    scores = torch.tensor([0.0, 1.0, 4.0, 1.0, 0.0])
    expect = normalize_reward(scores, mode, 1.5, algos.RunningMeanStd())
    torch.testing.assert_close(rewards.normalize(scores), expect, rtol=0, atol=0)
    assert expect.abs().max().item() == pytest.approx(1.5)  # the clip took
