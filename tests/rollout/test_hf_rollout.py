"""HFRollout: same interface as VLLMRollout, checked against a manual HF forward."""
import pytest
import torch

from tests.rollout.helpers import PROMPTS, load_hf, max_logprob_diff
from verl_ds.rollout import HFRollout, prompt_seeds
from verl_ds.rollout.hf_rollout import processed_logprobs


@pytest.fixture(scope="module")
def hf(model_pair):
    return HFRollout(model_pair[0], "fp32")


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_match_manual_forward(hf, model_pair, temperature):
    seeds = prompt_seeds(1, 3, range(len(PROMPTS)))
    batch = hf.generate(PROMPTS, n=2, temperature=temperature, max_new_tokens=8, seeds=seeds)
    assert len(batch) == 8 and batch.group_ids.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert max_logprob_diff(load_hf(model_pair[0]), batch, temperature) <= 1e-4
    for row, reason in zip(batch.to_lists()["responses"], batch.finish_reasons):
        assert (reason == "stop") == (row[-1] == 2) and 2 not in row[:-1]     # eos ends and is kept
    assert hf.last_metrics["perf/rollout_tokens_per_s"] > 0
    again = hf.generate(PROMPTS, n=2, temperature=temperature, max_new_tokens=8, seeds=seeds)
    assert torch.equal(again.response_ids, batch.response_ids)


def test_sync_and_bad_sync(hf, model_pair):
    new = load_hf(model_pair[1])
    assert hf.sync_weights(new.named_parameters())["timing_s/update_weights"] > 0
    batch = hf.generate(PROMPTS, n=1, temperature=0.0, max_new_tokens=6)
    assert max_logprob_diff(new, batch, 0.0) <= 1e-5
    with pytest.raises(ValueError, match="module.model.norm.weight"):
        hf.sync_weights([("module.model.norm.weight", torch.zeros(64))])
    with pytest.raises(ValueError, match="shape"):
        hf.sync_weights([("model.norm.weight", torch.zeros(3))])
    hf.sync_weights(load_hf(model_pair[0]).named_parameters())


def test_top_p_keeps_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    lp = processed_logprobs(logits, 1.0, top_p=0.7)
    assert torch.isinf(lp[0, 2:]).all() and torch.allclose(lp[0, :2].exp().sum(), torch.tensor(1.0))


def test_make_rollout_and_local_generation(model_pair):
    from verl_ds.config import RolloutConfig
    from verl_ds.rollout import generate_distributed, make_rollout

    hf = make_rollout(RolloutConfig(engine="hf"), model_pair[0], "fp32", seed=0)
    assert isinstance(hf, HFRollout) and hf.tp == 1
    a = generate_distributed(hf, [[1, 5], [1, 6]], n=4, temperature=1.0, top_p=1.0, max_new_tokens=6,
                             run_seed=1, step=0)
    b = generate_distributed(hf, [[1, 5], [1, 6]], n=4, temperature=1.0, top_p=1.0, max_new_tokens=6,
                             run_seed=1, step=0)
    c = generate_distributed(hf, [[1, 5], [1, 6]], n=4, temperature=1.0, top_p=1.0, max_new_tokens=6,
                             run_seed=1, step=1)
    assert len(a) == 8 and torch.equal(a.response_ids, b.response_ids)   # same (seed, step): same samples
    assert not torch.equal(a.response_ids, c.response_ids[:, :a.response_ids.shape[1]]) or \
        a.response_ids.shape != c.response_ids.shape                       # next step: a new stream


def test_prompt_seeds_are_unique_and_spaced():
    seeds = [s for step in range(50) for s in prompt_seeds(1, step, range(64))]
    assert len(set(seeds)) == len(seeds)
    ordered = sorted(seeds)
    assert min(b - a for a, b in zip(ordered, ordered[1:])) > 1024   # vLLM's per-sample streams s..s+n-1
    assert prompt_seeds(1, 3, [5]) == prompt_seeds(1, 3, [5]) != prompt_seeds(2, 3, [5])
