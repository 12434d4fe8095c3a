"""`rollout.engine: auto`: vLLM on GPUs and for real models, HF generate for tiny models on CPU."""
import pytest

from verl_ds.config import RolloutConfig, load_config
from verl_ds.errors import ConfigError
from verl_ds.rollout import HFRollout, choose_engine, make_rollout, resolve_engine
from verl_ds.rollout.distributed import AUTO_HF_MAX_PARAMS


@pytest.mark.parametrize("requested,params,cuda,engine", [
    ("auto", 330_000, False, "hf"),                       # the quickstart's model on CPU
    ("auto", AUTO_HF_MAX_PARAMS - 1, False, "hf"),
    ("auto", AUTO_HF_MAX_PARAMS, False, "vllm"),
    ("auto", 135_000_000, False, "vllm"),                 # SmolLM2 on CPU
    ("auto", 330_000, True, "vllm"),                      # any model on a GPU
    ("vllm", 330_000, False, "vllm"),                     # an explicit choice is kept
    ("hf", 135_000_000, True, "hf"),
])
def test_choose_engine(requested, params, cuda, engine):
    assert choose_engine(requested, params, cuda)[0] == engine


def test_auto_counts_the_checkpoints_parameters_and_builds_hf_generate_for_a_tiny_model(tiny_model_dir):
    cfg = RolloutConfig(engine="auto")
    assert resolve_engine(cfg, str(tiny_model_dir)) == "hf"
    rollout = make_rollout(cfg, str(tiny_model_dir), "fp32", seed=0)
    assert isinstance(rollout, HFRollout)


def test_the_quickstart_example_says_auto_and_a_bad_engine_names_the_choices():
    assert load_config("examples/grpo_cpu_tiny.yaml").rollout.engine == "auto"
    with pytest.raises(ConfigError, match="rollout.engine.*vllm, hf, auto"):
        load_config("examples/grpo_cpu_tiny.yaml", ["rollout.engine=fast"])
