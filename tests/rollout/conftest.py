"""Rollout fixtures: two tiny Llamas of the same shape and different weights, and an HF oracle."""

import pytest


@pytest.fixture(scope="session")
def model_pair(tmp_path_factory):
    """(dir of seed-0 model, dir of seed-1 model): same names and shapes, different weights."""
    from verl_ds.data.tiny import build_tiny_llama

    root = tmp_path_factory.mktemp("rollout_models")
    kw = dict(hidden=64, layers=2, heads=2, ffn=128)  # head_dim 32: vLLM CPU attention rejects 16
    return str(build_tiny_llama(root / "m0", seed=0, **kw)), str(build_tiny_llama(root / "m1", seed=1, **kw))
