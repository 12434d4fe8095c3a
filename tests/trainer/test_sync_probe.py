"""Every weight verified after a sync: the engine samples a fixed probe and the actor scores it; a
weight that did not land moves the probe's logprobs past the formats' bound and stops the run."""

import pytest

import verl_ds.trainer.rl_trainer as rl_trainer
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


def plant_stale(monkeypatch, trainer, part: str) -> None:
    """Every sync sends the initial value of each weight whose name holds `part` (a projection that
    never reaches the engine; with LoRA, the base weight of an adapted layer: the merge skipped)."""
    real = rl_trainer.iter_full_params
    initial = {n: t.clone() for n, t in real(trainer.actor.engine) if part in n}
    assert initial, part
    monkeypatch.setattr(rl_trainer, "iter_full_params", lambda e: ((n, initial.get(n, t)) for n, t in real(e)))


@pytest.mark.parametrize(
    "part, extra",
    [
        ("q_proj", []),
        ("gate_proj", []),
        ("down_proj", []),
        ("v_proj", ["model.lora.rank=4", "model.lora.target_modules=[q_proj,v_proj]", "roles.actor.lr=0.05"]),
    ],
)
def test_a_weight_that_did_not_land_stops_the_run_in_one_line(tmp_path, monkeypatch, part, extra):
    cfg = load_config(None, [*JOB, f"trainer.run_dir={tmp_path}", *extra])
    with RLTrainer(cfg) as trainer:
        plant_stale(monkeypatch, trainer, part)
        trainer.step()  # its sync sends the stale weight; the next step's probe sees it, before it trains
        with pytest.raises(RunFailure) as e:
            trainer.step()
    line = str(e.value)
    assert "\n" not in line and line.startswith("weight sync 1: the rollout engine's logprobs of a fixed probe are")
    assert "for fp32 vs fp32): a weight did not reach the engine" in line


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_a_correct_sync_passes_its_probe(tmp_path, dtype):
    cfg = load_config(
        None, [*JOB, f"trainer.run_dir={tmp_path}", *[f"precision.{k}_dtype={dtype}" for k in ("actor", "reference")]]
    )
    with RLTrainer(cfg) as trainer:
        assert "rollout/sync_probe_gap" not in trainer.step()  # no sync before step 1
        for _ in range(2):
            m = trainer.step()
            assert 0.0 <= m["rollout/sync_probe_gap"] <= rl_trainer.algos.probe_bound(dtype, "fp32")
            assert m["timing_s/sync_probe"] > 0
