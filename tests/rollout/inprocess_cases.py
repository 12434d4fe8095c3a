"""VLLMRollout in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0): tensors go to the worker directly.
Its own small engine (start ~10 s). Also checks the engine-death recovery path: a reload that
breaks the live model (wrong shape, sent behind the checker's back) must be survived by rebuilding
the engine from its checkpoint and replaying the update."""
import pytest
import torch

from tests.rollout.helpers import PROMPTS, load_hf, max_logprob_diff

pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def engine(model_pair):
    from verl_ds.rollout import VLLMRollout

    r = VLLMRollout(model_pair[0], "fp32", multiprocess=False, max_model_len=128, kv_cache_gb=0.05)
    yield r
    r.shutdown()


def test_inprocess_sync_matches_hf(engine, model_pair):
    new = load_hf(model_pair[1])
    engine.sync_weights(new.named_parameters())
    batch = engine.generate(PROMPTS, n=2, temperature=0.0, max_new_tokens=10)
    assert batch.group_ids.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert torch.equal(batch.response_ids[0], batch.response_ids[1])     # greedy copies agree
    diff = max_logprob_diff(new, batch, 0.0)
    print(f"in-process fp32 vLLM vs HF: max |dlogprob| = {diff:.2e}")
    assert diff <= 1e-4


def test_broken_engine_is_rebuilt_and_update_replayed(engine, model_pair):
    new = load_hf(model_pair[1])
    bad = [("model.layers.0.mlp.down_proj.weight", torch.zeros(3, 3))]
    with pytest.raises(Exception):   # behind the checker's back: leaves the live model broken
        engine.llm.collective_rpc("load_named_tensors", args=(bad,))
    m = engine.sync_weights(new.named_parameters())
    assert m["rollout/engine_restarts"] == 1 and engine.restarts == 1
    batch = engine.generate(PROMPTS, n=1, temperature=0.0, max_new_tokens=6)
    assert max_logprob_diff(new, batch, 0.0) <= 1e-4
