"""Every weight verified after a sync: the actor's first scoring of the step's own rows (free), or where
those cannot tell (partial rollouts) a fixed probe the engine samples, against the engine's logprobs; a
weight that did not land moves them past the formats' bound and stops the run before it trains."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import verl_ds.trainer.rl_trainer as rl_trainer
from tests.subprocess_env import child_env
from verl_ds.config import load_config
from verl_ds.errors import RunFailure
from verl_ds.trainer.rl_trainer import RLTrainer

FP32 = [f"precision.{k}_dtype=fp32" for k in ("actor", "reference", "rollout", "buffer")]
JOB = [
    "rollout.engine=hf",
    "trainer.prompts_per_step=4",
    "rollout.n=4",
    *FP32,
    "roles.actor.lr=0.01",  # weights that move: a stale copy differs
    "data.reward_fn=tests.e2e.helpers:length_reward",
    "logging.wandb.mode=disabled",
    "roles.actor.micro_batch_size=8",
    "roles.reference.micro_batch_size=8",
    "model.tiny.hidden=32",
    "model.tiny.ffn=64",
    "trainer.val_before_train=false",
]
VLLM_JOB = [o for o in JOB if not o.startswith("model.tiny.")]  # vLLM's CPU attention takes the default head size


def plant_stale(monkeypatch, trainer, part: str) -> None:
    """Every sync sends the initial value of each weight whose name holds `part` (a projection that
    never reaches the engine; with LoRA, the base weight of an adapted layer: the merge skipped)."""
    real = rl_trainer.iter_full_params
    initial = {n: t.clone() for n, t in real(trainer.actor.engine) if part in n}
    assert initial, part
    monkeypatch.setattr(rl_trainer, "iter_full_params", lambda e: ((n, initial.get(n, t)) for n, t in real(e)))


PARTIAL = ["rollout.partial.enabled=true", "algorithm.tis_cap=2.0"]
OLD_PASS = ["algorithm.ppo_epochs=2", "algorithm.use_kl_loss=false"]  # a KL in the reward: an old-policy pass


@pytest.mark.parametrize(
    "part, extra",
    [
        ("q_proj", []),
        ("q_proj", PARTIAL),
        ("gate_proj", OLD_PASS),
        ("down_proj", PARTIAL),
        ("v_proj", ["model.lora.rank=4", "model.lora.target_modules=[q_proj,v_proj]", "roles.actor.lr=0.05"]),
    ],
)
def test_a_weight_that_did_not_land_stops_the_run_in_one_line(tmp_path, monkeypatch, part, extra):
    cfg = load_config(None, [*JOB, f"trainer.run_dir={tmp_path}", *extra])
    with RLTrainer(cfg) as trainer:
        assert trainer.setup.sync_check == ("probe" if extra == PARTIAL else "rows")
        plant_stale(monkeypatch, trainer, part)
        trainer.step()  # its sync sends the stale weight; the next step's check sees it, before it trains
        steps = trainer.actor.engine.global_steps
        with pytest.raises(RunFailure) as e:
            trainer.step()
        assert trainer.actor.engine.global_steps == steps  # stopped before the optimizer stepped
    line = str(e.value)
    what = "a fixed probe" if extra == PARTIAL else "this step's rows"
    assert "\n" not in line and line.startswith(f"weight sync 1: the rollout engine's logprobs of {what} are")
    assert "for fp32 vs fp32): a weight did not reach the engine" in line


@pytest.mark.parametrize("dtype, extra", [("fp32", []), ("bf16", PARTIAL), ("bf16", OLD_PASS), ("fp16", [])])
def test_a_correct_sync_passes_its_check(tmp_path, dtype, extra):
    cfg = load_config(
        None,
        [
            *JOB,
            f"trainer.run_dir={tmp_path}",
            *extra,
            *[f"precision.{k}_dtype={dtype}" for k in ("actor", "reference")],
        ],
    )
    key = "sync_probe" if extra == PARTIAL else "sync_rows"
    with RLTrainer(cfg) as trainer:
        assert f"rollout/{key}_gap" not in trainer.step()  # no sync before step 1
        for _ in range(2):
            m = trainer.step()
            assert 0.0 <= m[f"rollout/{key}_gap"] <= rl_trainer.algos.probe_bound(dtype, "fp32")
            assert m[f"timing_s/{key}"] > 0
            assert ("rollout/sync_probe_gap" in m) == (extra == PARTIAL)  # the probe only where the rows cannot tell


def test_on_the_vllm_engine_too(tmp_path):
    """The same planted stale q_proj with vLLM generating: its sync's read-back serves no fused q/k/v
    under a checkpoint name, so the rows' check is what stops the run (`stale_vllm_script.py`)."""
    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "tests.trainer.stale_vllm_script", str(tmp_path), "q_proj"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=root, env=child_env())
    lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stdout[-3000:] + out.stderr[-3000:]
    res = json.loads(lines[-1].removeprefix("RESULT "))
    assert (res["engine"], res["check"], res["optimizer_stepped"]) == ("VLLMRollout", "rows", False)
    assert res["line"].startswith("weight sync 1: the rollout engine's logprobs of this step's rows are")
    assert res["line"].endswith("for fp32 vs fp32): a weight did not reach the engine")
