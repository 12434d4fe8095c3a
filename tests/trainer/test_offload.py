"""ZeRO-Offload per role (`roles.<role>.offload`) on real DeepSpeed engines, one process; the GPU
memory hand-off's order with a real vLLM engine (vllm_sleep_case.py, in a process of its own)."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.diagnostics.helpers import tiny_overrides
from tests.subprocess_env import child_env
from verl_ds.config import load_config
from verl_ds.diagnostics import memory as M
from verl_ds.ds_config import render_ds_configs, run_precision
from verl_ds.roles import ds_internals as dsi
from verl_ds.trainer.rl_trainer import RLTrainer


@pytest.mark.parametrize("stage", [2, 3])
def test_an_offloaded_optimizer_is_deepspeeds_cpu_adam_and_its_host_bytes_are_the_estimate(tmp_path, stage):
    """roles.actor.offload=optimizer: DeepSpeed runs ZeRO-Offload (DeepSpeedCPUAdam over the fp32
    master partition), and the estimator's host bytes for masters and Adam states are what the
    engine allocated (this rank's fp32 partitions and their exp_avg / exp_avg_sq)."""
    overrides = tiny_overrides(tmp_path) + [f"roles.actor.zero_stage={stage}", "roles.actor.offload=optimizer"]
    cfg = load_config(None, overrides)
    with RLTrainer(cfg) as trainer:
        trainer.step()
        opt = trainer.actor.engine.optimizer
        assert type(opt.optimizer).__name__ == "DeepSpeedCPUAdam"
        assert trainer.actor.engine.zero_offload_optimizer().device == "cpu"
        masters = dsi.master_params(trainer.actor.engine)
        master_bytes = sum(t.numel() * t.element_size() for t in masters)
        adam_bytes = sum(
            v.numel() * v.element_size()
            for s in opt.optimizer.state.values()
            for k, v in s.items()
            if k in ("exp_avg", "exp_avg_sq")
        )
        shape = M.load_shape(trainer.model_path)
    host = M.host_memory(cfg, shape, render_ds_configs(cfg, 1, run_precision(cfg)), 1)["actor"]
    assert host["master"] == master_bytes
    assert host["optimizer"] == adam_bytes


def test_offload_params_needs_zero3_and_a_frozen_role_has_no_optimizer_to_offload():
    from verl_ds.errors import ConfigError

    with pytest.raises(ConfigError, match="roles.actor.offload: offload params needs ZeRO stage 3"):
        load_config(None, ["roles.actor.zero_stage=2", "roles.actor.offload=params"])
    with pytest.raises(ConfigError, match="roles.reference.offload: the reference is frozen"):
        load_config(None, ["roles.reference.offload=optimizer"])
    with pytest.raises(ConfigError, match="roles.actor.sleep"):
        load_config(None, ["roles.actor.zero_stage=0", "roles.actor.sleep=true"])
    # DeepSpeed's BF16_Optimizer (bf16 + fp32 grad accumulation at stage 1) has no offload_states
    asleep = ["roles.actor.zero_stage=1", "roles.actor.sleep=true", "precision.actor_dtype=bf16"]
    with pytest.raises(ConfigError, match="roles.actor.sleep: bf16 with fp32 grad accumulation at ZeRO stage 1"):
        render_ds_configs(load_config(None, [*asleep, "precision.grad_accum_dtype=fp32"]), 1)
    assert "grad_accum_dtype" not in render_ds_configs(load_config(None, asleep), 1)["actor"].get("data_types", {})
    cfg = load_config(None, ["roles.reference.ds_config=ref_zero3.json", "roles.reference.offload=params"])
    assert render_ds_configs(cfg, 1)["reference"]["zero_optimization"]["offload_param"]["device"] == "cpu"


def test_sleep_is_accepted_on_cpu_and_says_it_is_a_no_op(tmp_path, caplog):
    """roles.actor.sleep on CPU: the run trains, one log line says nothing moves, the role stays awake."""
    import logging

    cfg = load_config(None, tiny_overrides(tmp_path) + ["roles.actor.zero_stage=3", "roles.actor.sleep=true"])
    with caplog.at_level(logging.INFO, logger="verl_ds"), RLTrainer(cfg) as trainer:
        trainer.step()
        assert not trainer.actor.asleep and trainer.actor.sleep() is False
    assert sum("sleep: a no-op on CPU" in r.getMessage() for r in caplog.records) == 1


def test_the_memory_hand_off_order_with_a_real_vllm_engine_in_a_fresh_process():
    pytest.importorskip("vllm")
    here = Path(__file__).resolve().parent
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(here / "vllm_sleep_case.py")],
        env=child_env(),
        cwd=here.parents[1],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0 and "1 passed" in out.stdout, out.stdout[-4000:] + out.stderr[-2000:]
