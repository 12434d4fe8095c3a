"""End to end through the deepspeed launcher with 2 CPU ranks, gloo and a real vLLM engine."""
import math

import pytest
import torch
from safetensors.torch import load_file

from tests.e2e.helpers import read_metrics, run_train, run_until_step, wandb_history

pytestmark = pytest.mark.e2e
FAST = ["trainer.prompts_per_step=8", "rollout.n=8", "logging.sample_every=2", "roles.actor.micro_batch_size=16",
        "roles.critic.micro_batch_size=16", "roles.reference.micro_batch_size=16",
        "data.reward_fn=tests.e2e.helpers:length_reward",
        # pinned: the fp32 rollout-vs-trainer bound below must not follow the CPU kind (`auto`)
        *[f"precision.{k}_dtype=fp32" for k in ("actor", "critic", "reference", "rollout", "buffer")]]
KEYS = ["reward/mean", "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/grad_norm",
        "response_length/mean", "timing_s/gen", "timing_s/update_actor", "timing_s/update_weights",
        "timing_s/step", "perf/throughput", "precision/actor/loss_scale", "precision/actor/skipped_steps",
        "rollout_corr/logprob_abs_diff_mean", "rollout_corr/logprob_abs_diff_max", "rollout_corr/k3_kl"]


def _check_run(run_dir, steps, extra_keys=()):
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        for k in KEYS + list(extra_keys):
            assert k in r and r[k] is not None and math.isfinite(r[k]), (k, r.get(k))
    # vLLM holds the actor's weights after every sync: in fp32 the rollout and the trainer agree
    for r in rows[1:]:
        assert r["rollout_corr/logprob_abs_diff_max"] < 1e-3, r["rollout_corr/logprob_abs_diff_max"]
    hist = [h for h in wandb_history(run_dir) if "reward/mean" in str(h)]
    assert len(hist) >= steps, "W&B offline run lacks the step history"
    init = load_file(str(run_dir / "init_model" / "model.safetensors"))
    final = load_file(str(run_dir / "final_model" / "model.safetensors"))
    assert any(not torch.equal(init[k], final[k]) for k in final), "actor weights did not change"
    return rows


def test_grpo_three_steps(tmp_path):
    run_train("grpo_cpu_tiny.yaml", tmp_path, "trainer.steps=3", *FAST)
    _check_run(tmp_path, 3)
    assert (tmp_path / "reward_curve.png").stat().st_size > 0


def test_ppo_gae_critic_three_steps(tmp_path):
    run_train("ppo_cpu_tiny.yaml", tmp_path, "trainer.steps=3", *FAST)
    _check_run(tmp_path, 3, ["critic/vf_loss", "critic/vf_explained_var", "timing_s/values",
                             "timing_s/update_critic", "precision/critic/loss_scale"])


def test_kill_after_step_2_then_resume_auto(tmp_path):
    ref = tmp_path / "ref"
    run_train("grpo_cpu_tiny.yaml", ref, "trainer.steps=3", *FAST)
    want = read_metrics(ref)[2]["data/position"]

    killed = tmp_path / "killed"
    run_until_step("grpo_cpu_tiny.yaml", killed, 3, "trainer.steps=50", "checkpoint.every=2", *FAST)
    assert (killed / "checkpoints" / "step_2" / "trainer_state.json").exists()
    assert not list((killed / "checkpoints").glob(".*.tmp"))
    before = len(read_metrics(killed))
    run_train("grpo_cpu_tiny.yaml", killed, "trainer.steps=3", "trainer.resume=auto", "checkpoint.every=2", *FAST)
    resumed = read_metrics(killed)[before:]
    assert [r["step"] for r in resumed] == [3]
    assert resumed[0]["data/position"] == want
