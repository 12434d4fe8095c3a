"""`rollout.engine: auto`: vLLM on GPUs and for real models, HF generate for tiny models on CPU."""

from dataclasses import replace

import pytest

from verl_ds.config import RolloutConfig, load_config
from verl_ds.errors import ConfigError
from verl_ds.rollout import HFRollout, choose_engine, make_rollout, resolve_engine
from verl_ds.rollout.engines.distributed import AUTO_HF_MAX_PARAMS


@pytest.mark.parametrize(
    "requested,params,cuda,engine",
    [
        ("auto", 330_000, False, "hf"),  # the quickstart's model on CPU
        ("auto", AUTO_HF_MAX_PARAMS - 1, False, "hf"),
        ("auto", AUTO_HF_MAX_PARAMS, False, "vllm"),
        ("auto", 135_000_000, False, "vllm"),  # SmolLM2 on CPU
        ("auto", 330_000, True, "vllm"),  # any model on a GPU
        ("vllm", 330_000, False, "vllm"),  # an explicit choice is kept
        ("hf", 135_000_000, True, "hf"),
    ],
)
def test_choose_engine(requested, params, cuda, engine):
    assert choose_engine(requested, params, cuda)[0] == engine


def test_auto_counts_the_models_parameters_and_builds_hf_generate_for_a_tiny_model(tiny_model_dir):
    from verl_ds.diagnostics.memory import load_shape

    cfg = RolloutConfig(engine="auto")
    params = load_shape(str(tiny_model_dir)).params("lm")
    assert resolve_engine(cfg, params, gpu=False) == "hf"
    assert resolve_engine(cfg, params, gpu=False, sequence_parallel=2) == "vllm"  # HF would run the split model
    with pytest.raises(ValueError, match="resolve it first"):  # one place decides: the trainer, once
        make_rollout(cfg, str(tiny_model_dir), "fp32", seed=0)
    rollout = make_rollout(RolloutConfig(engine="hf"), str(tiny_model_dir), "fp32", seed=0)
    assert isinstance(rollout, HFRollout)


def test_vllm_missing_falls_back_to_hf_generate_in_one_warning(tiny_model_dir, monkeypatch, caplog):
    """Asked for vLLM where it does not import, the run samples with HF generate and says so once."""
    import logging
    import sys

    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    with caplog.at_level(logging.INFO, logger="verl_ds.rollout"):
        assert resolve_engine(RolloutConfig(engine="vllm"), 330_000, gpu=False) == "hf"
    said = [r for r in caplog.records if "vllm" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING, [r.getMessage() for r in said]
    assert "falling back to HF generate" in said[0].getMessage()
    with pytest.raises(ConfigError, match="sequence_parallel_size 2 needs vLLM"):  # no engine to fall back on
        resolve_engine(RolloutConfig(engine="auto"), 330_000, gpu=False, sequence_parallel=2)


def test_a_trainer_resolves_auto_before_building_and_a_bad_engine_names_the_choices(tmp_path):
    from tests.diagnostics.helpers import tiny_overrides
    from verl_ds.trainer.rl_trainer import RLTrainer

    cfg = load_config(None, tiny_overrides(tmp_path) + ["rollout.engine=auto"])
    with RLTrainer(cfg) as trainer:
        assert trainer.cfg.rollout.engine == "hf" and isinstance(trainer.rollout, HFRollout)
        assert trainer.step()["timing_s/gen"] > 0
    with pytest.raises(ConfigError, match="rollout.engine.*vllm, hf, auto"):
        load_config(None, ["rollout.engine=fast"])


def test_the_memory_estimate_follows_auto():
    from verl_ds.diagnostics.memory.estimate import ModelShape, estimate_memory
    from verl_ds.ds_config import render_ds_configs, run_precision

    tiny = ModelShape(vocab=64, hidden=128, layers=2, heads=4, kv_heads=4, ffn=256, head_dim=32)
    cfg = load_config(
        None,
        [
            "rollout.engine=auto",
            "precision.rollout_dtype=fp32",
            "precision.actor_dtype=fp32",
            "precision.reference_dtype=fp32",
        ],
    )
    ds = render_ds_configs(cfg, 1, precision=run_precision(cfg))
    cpu = estimate_memory(cfg, tiny, ds, 1, "fp32")
    gpu = estimate_memory(cfg, tiny, ds, 1, "fp32", gpu_gib=80.0)
    # HF generate holds its KV cache only while generating; vLLM reserves its pool for the whole step,
    # unless it sleeps while the roles train (rollout.sleep, GPU)
    assert "kv_cache" not in cpu["update"]["rollout"] and cpu["rollout"]["rollout"]["kv_cache"] > 0
    assert gpu["rollout"]["rollout"]["kv_cache"] > 0 and gpu["update"]["rollout"] == {}
    awake = replace(cfg, rollout=replace(cfg.rollout, sleep=False))
    assert estimate_memory(awake, tiny, ds, 1, "fp32", gpu_gib=80.0)["update"]["rollout"]["kv_cache"] > 0


def test_both_engines_implement_the_whole_rollout_engine_protocol(tiny_model_dir):
    """Every member of RolloutEngine, on both classes, with the Protocol's parameter names (the loop
    calls them without probing)."""
    import inspect

    from verl_ds.rollout import RolloutEngine, VLLMRollout

    methods = [n for n, v in vars(RolloutEngine).items() if callable(v) and not n.startswith("_")]
    assert set(methods) == {"generate", "stream", "sync_weights", "sleep", "wake_up", "shutdown"}
    for cls in (HFRollout, VLLMRollout):
        for name in methods:
            want = list(inspect.signature(getattr(RolloutEngine, name)).parameters)
            assert list(inspect.signature(getattr(cls, name)).parameters) == want, (cls.__name__, name)
    from verl_ds.rollout.engines.engine import TokenStream
    from verl_ds.rollout.engines.hf_rollout import ChunkedStream
    from verl_ds.rollout.engines.vllm_rollout import VLLMStream

    for cls in (ChunkedStream, VLLMStream):  # what `stream` returns: the whole TokenStream
        for name in ("add", "step", "close", "__len__"):
            want = list(inspect.signature(getattr(TokenStream, name)).parameters)
            assert list(inspect.signature(getattr(cls, name)).parameters) == want, (cls.__name__, name)
    hf = make_rollout(RolloutConfig(engine="hf"), str(tiny_model_dir), "fp32", seed=0)
    assert isinstance(hf, RolloutEngine) and hf.tp == 1  # data members too (runtime check)
    assert {"tp", "start_s", "last_metrics", "pad_id"} <= set(RolloutEngine.__annotations__)
