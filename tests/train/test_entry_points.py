"""Issue 8's entry points: PPOTrainer, the SFT Trainer, python -m verl_ds.train.ppo."""

import math
import subprocess
import sys

import pytest
import torch

from verl_ds.config import DataConfig, ModelConfig, TinyModelConfig, load_config
from verl_ds.ds_config import render_ds_configs
from verl_ds.errors import ConfigError
from verl_ds.precision import PrecisionConfig

TINY = ModelConfig(path="tiny", tiny=TinyModelConfig(hidden=32, ffn=64))


def test_yaml_and_python_paths_render_identical_ds_configs(tmp_path):
    from verl_ds import PPOTrainer

    yaml_cfg = tmp_path / "run.yaml"
    yaml_cfg.write_text(
        "precision: {actor_dtype: fp16, critic_dtype: bf16, actor_comm_dtype: bf16}\nalgorithm: {estimator: gae}\n"
    )
    from_yaml = render_ds_configs(load_config(yaml_cfg), world_size=1)
    api = PPOTrainer(
        precision_config=PrecisionConfig(actor_dtype="fp16", critic_dtype="bf16", actor_comm_dtype="bf16"),
        algorithm_config={"estimator": "gae"},
    )
    assert api.render_ds_configs(world_size=1) == from_yaml
    assert from_yaml["actor"]["communication_data_type"] == "bf16"  # comm dtype reaches DeepSpeed
    assert from_yaml["critic"]["bf16"] == {"enabled": True}
    with pytest.raises(TypeError, match="precison_config"):  # explicit keywords: a typo is caught
        PPOTrainer(precison_config=PrecisionConfig())
    import inspect

    assert {"model_config", "precision_config", "trainer_config", "reward_fn"} <= set(
        inspect.signature(PPOTrainer).parameters
    )


def test_ppo_trainer_fit_two_grpo_steps_in_one_process(tmp_path):
    from verl_ds import PPOTrainer

    seen = []

    def reward_fn(response, answer):
        seen.append(response)
        return float(response.strip() == answer)

    metrics = PPOTrainer(
        model_config=TINY,
        data_config=DataConfig(task="arithmetic"),
        precision_config=PrecisionConfig(actor_dtype="fp32", buffer_dtype="fp32"),
        rollout_config={"engine": "hf", "n": 4, "max_new_tokens": 3},
        trainer_config={"steps": 2, "prompts_per_step": 4, "run_dir": str(tmp_path)},
        roles_config={"actor": {"micro_batch_size": 8}, "reference": {"micro_batch_size": 8}},
        logging_config={"wandb": {"mode": "disabled"}},
        reward_fn=reward_fn,
    ).fit()
    assert len(seen) == 2 * 4 * 4  # the user's reward function scored every sample
    assert math.isfinite(metrics["actor/pg_loss"]) and "reward/mean" in metrics
    assert (tmp_path / "final_model" / "model.safetensors").exists()


def _sft_data(n=64):
    from verl_ds.data.tasks import arithmetic_examples

    return [{"prompt": e["prompt"], "completion": e["answer"]} for e in arithmetic_examples(n, seed=0)]


@pytest.mark.parametrize("precision,grad_scaler", [("fp32", None), ("bf16", None), ("fp16", True)])
def test_sft_trainer_lowers_loss(tiny_model_dir, precision, grad_scaler, tmp_path):
    from verl_ds import Trainer

    t = Trainer(
        tiny_model_dir, strategy="zero2", precision=precision, grad_scaler=grad_scaler, lr=3e-3, micro_batch_size=16
    )
    losses = t.fit(_sft_data(), epochs=6)
    print(precision, [round(x, 3) for x in losses[:2]], "->", [round(x, 3) for x in losses[-2:]])
    assert sum(losses[-2:]) / 2 < 0.8 * sum(losses[:2]) / 2
    assert t.skipped_steps == 0
    out = t.save(tmp_path / "sft")
    import json

    from safetensors.torch import load_file

    want = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    assert all(v.dtype == want for v in load_file(str(out / "model.safetensors")).values())
    assert json.loads((out / "config.json").read_text())["dtype"] == str(want).split(".")[1]


def test_sft_fp16_forced_overflow_is_skipped_and_counted(tiny_model_dir):
    from verl_ds import Trainer

    class Overflowing(Trainer):
        calls = 0

        def compute_loss(self, batch):
            Overflowing.calls += 1
            loss = super().compute_loss(batch)
            return loss * float("inf") if Overflowing.calls == 1 else loss

    t = Overflowing(tiny_model_dir, strategy="zero2", precision="fp16", grad_scaler=True, micro_batch_size=16)
    before = {n: p.clone() for n, p in t.engine.module.named_parameters()}
    t.fit(_sft_data(16), max_steps=1)
    assert t.skipped_steps == 1
    assert all(torch.equal(p, before[n]) for n, p in t.engine.module.named_parameters())
    t.fit(_sft_data(16), max_steps=1)
    assert t.skipped_steps == 1 and t.precision_stats()["loss_scale"] == 2048.0


@pytest.mark.parametrize("cpu_gemm,want", [("fp32", ["Fp32Gemm"]), ("native", [])])
def test_sft_passes_run_under_the_resolved_gemm(tiny_model_dir, cpu_gemm, want):
    from torch.overrides import _get_current_function_mode_stack

    from verl_ds import Trainer

    class Watching(Trainer):
        modes = []

        def compute_loss(self, batch):
            Watching.modes.append([type(m).__name__ for m in _get_current_function_mode_stack()])
            return super().compute_loss(batch)

    t = Watching(tiny_model_dir, strategy="zero2", precision="bf16", micro_batch_size=16, cpu_gemm=cpu_gemm)
    assert t.fp32_gemm == (("bf16",) if cpu_gemm == "fp32" else ())
    losses = t.fit(_sft_data(16), max_steps=1)
    assert Watching.modes and all(m == want for m in Watching.modes)
    assert losses[0] == losses[0] and _get_current_function_mode_stack() == []


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"precision": "bf16", "grad_scaler": True}, "fp16 only"),
        ({"precision": "fp32", "grad_scaler": True}, "fp16 only"),
        ({"strategy": "fsdp"}, "zero3"),
        ({"cpu_gemm": "fast"}, "cpu_gemm.*'fast' is not one of auto, fp32, native"),
    ],
)
def test_sft_bad_arguments_say_why(tiny_model_dir, kwargs, match):
    from verl_ds import Trainer

    with pytest.raises(ConfigError, match=match):
        Trainer(tiny_model_dir, **kwargs)


def test_python_m_train_ppo_help_and_bad_flag():
    out = subprocess.run([sys.executable, "-m", "verl_ds.train.ppo", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for flag in ("--model_name_or_path", "--rollout_batch_size", "--train_batch_size", "--config"):
        assert flag in out.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "verl_ds.train.ppo", "--rollout_batch_size", "many"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "many" in bad.stderr


def test_train_ppo_flags_map_onto_run_config():
    from verl_ds.train.ppo import build_parser, to_overrides

    args = build_parser().parse_args(
        ["--model_name_or_path", "/m", "--rollout_batch_size", "64", "--train_batch_size", "32", "rollout.n=4"]
    )
    cfg = load_config(None, to_overrides(args))
    assert (cfg.model.path, cfg.trainer.prompts_per_step, cfg.trainer.mini_batch_size, cfg.rollout.n) == (
        "/m",
        64,
        32,
        4,
    )
