"""HFRollout: same interface as VLLMRollout, checked against a manual HF forward."""
import pytest
import torch

from tests.rollout.helpers import PROMPTS, load_hf, max_logprob_diff
from verl_ds.rollout import HFRollout
from verl_ds.rollout.hf_rollout import processed_logprobs


@pytest.fixture(scope="module")
def hf(model_pair):
    return HFRollout(model_pair[0], "fp32", seed=0)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_match_manual_forward(hf, model_pair, temperature):
    batch = hf.generate(PROMPTS, n=2, temperature=temperature, max_new_tokens=8, seed=3)
    assert len(batch) == 8 and batch.group_ids.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert max_logprob_diff(load_hf(model_pair[0]), batch, temperature) <= 1e-4
    for row, reason in zip(batch.to_lists()["responses"], batch.finish_reasons):
        assert (reason == "stop") == (row[-1] == 2) and 2 not in row[:-1]     # eos ends and is kept
    assert hf.last_metrics["perf/rollout_tokens_per_s"] > 0
    again = hf.generate(PROMPTS, n=2, temperature=temperature, max_new_tokens=8, seed=3)
    assert torch.equal(again.response_ids, batch.response_ids)


def test_sync_and_bad_sync(hf, model_pair):
    new = load_hf(model_pair[1])
    m = hf.sync_weights(new.named_parameters())
    assert m["rollout/engine_restarts"] == 0
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


def test_make_rollout_layouts(model_pair):
    from verl_ds.config import RolloutConfig
    from verl_ds.errors import ConfigError
    from verl_ds.rollout import generate_distributed, make_rollout, sync_distributed
    from verl_ds.rollout.distributed import _cpu_bind_for_rank

    hf = make_rollout(RolloutConfig(engine="hf"), model_pair[0], "fp32", rank=1, world_size=2, seed=0)
    assert isinstance(hf, HFRollout)                              # HF: every rank owns one
    with pytest.raises(ConfigError, match="rollout.multiprocess"):  # would deadlock in LLM()
        make_rollout(RolloutConfig(engine="vllm", multiprocess=False), model_pair[0], "fp32", 0, 2, 0)
    assert make_rollout(RolloutConfig(engine="vllm"), model_pair[0], "fp32", rank=1, world_size=2, seed=0) is None
    assert sync_distributed(None, iter([("x", torch.zeros(1))])) == {}   # drains, owns no engine
    batch = generate_distributed(hf, [[1, 5]], n=2, temperature=0.0, top_p=1.0, max_new_tokens=3)
    assert len(batch) == 2                                          # world 1: local
    binds = [_cpu_bind_for_rank(r, 2) for r in range(2)]
    assert binds[0] and binds[1] and (binds[0] != binds[1] or len(binds[0].split(",")) == 1)
