"""The loop in one process (HF rollout, real DeepSpeed engines, W&B disabled): on-policy invariants."""

import logging
import math

import pytest
import torch

from verl_ds.config import load_config
from verl_ds.errors import RunFailure
from verl_ds.trainer.rl_trainer import RLTrainer

FP32 = [f"precision.{k}_dtype=fp32" for k in ("actor", "critic", "reference", "rollout", "buffer")]
# 4 prompts x 4 samples on the HF engine, fp32, a KL loss to the reference, rewarded by length
KL_JOB = [
    "rollout.engine=hf",
    "trainer.prompts_per_step=4",
    "rollout.n=4",
    *FP32,
    "algorithm.use_kl_loss=true",
    "data.reward_fn=tests.e2e.helpers:length_reward",
    "logging.wandb.mode=disabled",
    "roles.actor.micro_batch_size=4",
    "roles.reference.micro_batch_size=8",
    "model.tiny.hidden=32",
    "model.tiny.ffn=64",
]


@pytest.mark.numerics
def test_a_shared_prefix_step_trains_as_the_plain_step(tmp_path):
    """`model.share_prompt` (default on), with gradient checkpointing: every pass runs each prompt once for
    its 4 samples; the step scores the rollout as the engine did and its losses equal the plain step's on
    the same rollout; `perf/shared_tokens` says how much was shared (1.0 in the plain step)."""
    steps = {}
    for share in ("false", "true"):
        job = [f"model.share_prompt={share}", "algorithm.kl_coef=0.01", f"trainer.run_dir={tmp_path / share}"]
        job += ["precision.enable_grad_checkpointing=true", "model.share_prefix_min_tokens=0"]
        with RLTrainer(load_config(None, [*KL_JOB, *job])) as trainer:
            assert trainer.actor.share_prefixes == trainer.reference.share_prefixes == (share == "true")
            steps[share] = trainer.step()
    plain, shared = steps["false"], steps["true"]
    assert shared["rollout_corr/logprob_abs_diff_max"] < 1e-4
    for k in ("reward/mean", "actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/kl_ref", "actor/grad_norm"):
        assert math.isclose(shared[k], plain[k], rel_tol=1e-4, abs_tol=1e-6), k
    for p in ("actor/update", "reference/score"):
        assert plain[f"perf/shared_tokens/{p}"] == 1.0
        assert shared[f"perf/shared_tokens/{p}"] < 0.8, (p, shared[f"perf/shared_tokens/{p}"])
        assert shared[f"perf/padding_efficiency/{p}"] == 1.0


@pytest.mark.numerics
@pytest.mark.parametrize("epochs", [2])
def test_truncated_sampling_is_scored_under_the_set_it_was_drawn_from(tmp_path, epochs):
    """top-k + top-p at temperature 0.7: the rollout's logprobs are of the renormalised kept set, and
    every pass (the update's forward, the old policy's own pass at 2 epochs with a KL in the reward,
    the reference) scores the same set: the fp32 pair agrees to rounding. Scored against the whole
    vocabulary, the same job's IS weights sit near the kept mass (~0.8), far outside these bounds."""
    job = ["rollout.top_k=8", "rollout.top_p=0.8", "rollout.temperature=0.7", f"algorithm.ppo_epochs={epochs}"]
    job += [f"trainer.run_dir={tmp_path}"] + ["algorithm.use_kl_loss=false", "algorithm.kl_coef=0.01"] * (epochs == 2)
    with RLTrainer(load_config(None, [*KL_JOB, *job])) as trainer:
        assert trainer.setup.sampled == (0.7, 8, 0.8)
        for _ in range(2):
            m = trainer.step()
            assert m["rollout_corr/logprob_abs_diff_max"] < 1e-4
            assert abs(m["rollout_corr/is_weight_mean"] - 1.0) < 1e-4
            assert ("timing_s/old_logprob" in m) == (epochs == 2)
            assert math.isfinite(m["actor/entropy"]) and m["actor/kl_ref"] >= 0


@pytest.mark.numerics
def test_the_trainer_against_itself_every_k_steps(tmp_path):
    """`logging.consistency_every: 2`: steps 1 and 3 score a few rows again, each alone, on the weights the
    step's first scoring ran on (here the shared-prefix, token-budget passes of an on-policy update), and
    `trainer_corr/` compares: fp32, so to rounding; step 2 runs no such pass."""
    job = [
        "logging.consistency_every=2",
        "roles.actor.max_tokens_per_micro_batch=64",
        "model.share_prefix_min_tokens=0",
    ]
    with RLTrainer(load_config(None, [*KL_JOB, *job, f"trainer.run_dir={tmp_path}"])) as trainer:
        steps = [trainer.step() for _ in range(3)]
    for m in steps[::2]:
        assert m["trainer_corr/logprob_abs_diff_max"] < 1e-5 and m["trainer_corr/phantom_clip_fraction"] == 0.0
        assert m["trainer_corr/log_ratio_abs_p99"] <= m["trainer_corr/log_ratio_abs_max"] < 1e-5
        assert m["timing_s/consistency"] > 0 and m["perf/shared_tokens/actor/update"] < 1.0
    assert not [k for k in steps[1] if k.startswith("trainer_corr/") or k == "timing_s/consistency"]


@pytest.mark.parametrize("mode", ["warn", "stop"])
def test_the_mismatch_gate_says_the_pair_the_step_and_the_numbers(tmp_path, caplog, mode):
    """A bf16 rollout against the fp32 trainer under a clip band of +-0.1%: its rounding puts tokens
    outside the band (the gate reads the share on the same weights, gathered over ranks); past the
    bf16 pair's default bound, one line: a warning and the run goes on, or the run's end."""
    job = ["precision.rollout_dtype=bf16", "algorithm.clip_low=0.001", "algorithm.clip_high=0.001"]
    job += [f"algorithm.mismatch_gate={mode}", f"trainer.run_dir={tmp_path}"]
    with RLTrainer(load_config(None, [*KL_JOB, *job])) as trainer:
        assert trainer.setup.gate.bound == 0.05 and trainer.setup.gate.pair == "fp32 actor vs bf16 rollout"
        if mode == "stop":
            with pytest.raises(RunFailure) as e:
                trainer.step()
            line = str(e.value)
        else:
            with caplog.at_level(logging.WARNING, logger="verl_ds.trainer.consistency"):
                m = trainer.step()
            assert m["rollout_corr/phantom_clip_fraction"] > 0.05 and trainer.global_step == 1
            (line,) = [
                r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "gate" in r.getMessage()
            ]
    assert "\n" not in line and line.startswith("mismatch gate: step 1: ")
    assert (
        "of response tokens outside the clip band on the same weights (fp32 actor vs bf16 rollout; bound 5.00%" in line
    )
    assert "|log ratio| p99" in line


@pytest.mark.numerics
def test_lr_zero_on_policy_ratio_is_one(tmp_path):
    cfg = load_config(
        None,
        [
            "rollout.engine=hf",
            "trainer.steps=2",
            "trainer.prompts_per_step=4",
            "rollout.n=4",
            "roles.actor.lr=0.0",
            *FP32,
            "algorithm.ppo_epochs=1",
            f"trainer.run_dir={tmp_path}",
            "logging.wandb.mode=disabled",
            "roles.actor.micro_batch_size=8",
            "roles.reference.micro_batch_size=8",
            "model.tiny.hidden=32",
            "model.tiny.ffn=64",
        ],
    )
    with RLTrainer(cfg) as trainer:
        for _ in range(2):
            m = trainer.step()
            assert m["actor/pg_clipfrac"] == 0.0
            assert abs(m["actor/ppo_kl"]) < 1e-6
            assert m["rollout_corr/logprob_abs_diff_max"] < 1e-4  # HF rollout in fp32 = the trainer's weights
            assert "timing_s/old_logprob" not in m  # used once: no separate old-policy pass
            assert "actor/kl_ref" in m and m["actor/kl_ref"] >= 0
            assert math.isfinite(m["actor/pg_loss"])
    assert trainer.logger is None and trainer.rollout is None  # closed on exit


@pytest.mark.numerics
def test_a_packed_step_trains_as_the_padded_step(tmp_path):
    """`model.packing: true`: the actor's and the reference's passes run padding-free rows; the step
    scores the rollout as the rollout engine did (fp32: its logprobs within 1e-4) and its losses
    equal the padded step's on the same rollout, with no padding run in the update."""
    steps = {}
    for packing in ("false", "true"):
        job = [f"model.packing={packing}", "algorithm.kl_coef=0.01", f"trainer.run_dir={tmp_path / packing}"]
        job.append("model.share_prompt=false")  # packs of whole rows (shared prefixes: the next test)
        cfg = load_config(None, [*KL_JOB, *job])
        with RLTrainer(cfg) as trainer:
            assert trainer.actor.packing == trainer.reference.packing == (packing == "true")
            steps[packing] = trainer.step()
    padded, packed = steps["false"], steps["true"]
    assert packed["rollout_corr/logprob_abs_diff_max"] < 1e-4
    for k in ("reward/mean", "actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/kl_ref"):
        assert math.isclose(packed[k], padded[k], rel_tol=1e-4, abs_tol=1e-6), k
    assert packed["perf/padding_efficiency/actor/update"] == 1.0
    assert padded["perf/padding_efficiency/actor/update"] < 1.0


@pytest.mark.numerics
@pytest.mark.parametrize("budget", [0, 40])
def test_two_epochs_reuse_the_first_forward_as_the_old_policy(tmp_path, budget):
    """One mini-batch per epoch: epoch 2's old logprobs come from epoch 1's forward (no separate
    pass) and equal what a separate old-policy pass gives on the same rows, also when a token budget
    packs the micro-batches by length, out of row order."""
    job = [f"roles.actor.max_tokens_per_micro_batch={budget}", "algorithm.ppo_epochs=2", f"trainer.run_dir={tmp_path}"]
    cfg = load_config(None, [*KL_JOB, *job])
    from verl_ds.diagnostics.observers import TrainerObserver

    class Spy(TrainerObserver):
        def on_train_batch(self, trainer, train):
            seen["separate"] = trainer.actor.logprobs(train, trainer.setup.sampled).float()
            seen["on_policy"] = train.on_policy and train.old_logprobs is None

    seen = {}
    with RLTrainer(cfg) as trainer:
        trainer.observers.append(Spy())
        update = trainer._update

        def recorded(*args):  # what the first epoch's forward hands the second as its old policy
            metrics, first_lp = update(*args)
            seen["stored"] = trainer._buffered(first_lp)
            return metrics, first_lp

        trainer._update = recorded
        m = trainer.step()
    assert seen["on_policy"] and "timing_s/old_logprob" not in m
    assert seen["stored"].shape == seen["separate"].shape and seen["stored"].shape[0] == 16
    torch.testing.assert_close(seen["stored"], seen["separate"], rtol=0, atol=1e-5)
    assert m["actor/ppo_kl"] != 0.0 and math.isfinite(m["actor/ppo_kl"])  # epoch 2 ran off-policy on them


@pytest.mark.parametrize("estimator", ["gae", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"])
def test_every_estimator_runs_a_step(tmp_path, estimator):
    cfg = load_config(
        None,
        [
            "rollout.engine=hf",
            "trainer.steps=1",
            "trainer.prompts_per_step=4",
            "rollout.n=4",
            f"algorithm.estimator={estimator}",
            f"trainer.run_dir={tmp_path}",
            "logging.wandb.mode=disabled",
            "roles.actor.micro_batch_size=8",
            "roles.critic.micro_batch_size=8",
            "roles.reference.micro_batch_size=8",
            "model.tiny.hidden=32",
            "model.tiny.ffn=64",
        ],
    )
    with RLTrainer(cfg) as trainer:
        assert ("critic" in trainer.roles) == (estimator == "gae")  # no critic engine unless needed
        assert trainer.actor.max_tokens == 8 * (cfg.data.max_prompt_length + cfg.rollout.max_new_tokens)  # auto
        m = trainer.step()
    assert math.isfinite(m["actor/pg_loss"])
    passes = ["actor/update", "reference/score"] + (["critic/score", "critic/update"] if estimator == "gae" else [])
    for p in passes:  # real tokens / tokens run, every scoring and update pass of the step
        assert 0 < m[f"perf/padding_efficiency/{p}"] <= 1, (p, m)
    if estimator == "gae":
        assert math.isfinite(m["critic/vf_loss"]) and "critic/vf_explained_var" in m


def test_buffer_dtype_bf16_rounds_what_the_buffer_stores(tmp_path):
    cfg = load_config(
        None,
        [
            "rollout.engine=hf",
            "precision.buffer_dtype=bf16",
            f"trainer.run_dir={tmp_path}",
            "logging.wandb.mode=disabled",
            "model.tiny.hidden=32",
            "model.tiny.ffn=64",
        ],
    )
    with RLTrainer(cfg) as trainer:
        x = torch.randn(4, 3, dtype=torch.float32)
        stored = trainer._buffered(x)
    assert stored.dtype == torch.float32 and torch.equal(stored, x.to(torch.bfloat16).float())
    assert not torch.equal(stored, x)


def test_token_rewards_put_the_score_on_the_last_response_token():
    from verl_ds.trainer.advantages import token_rewards as _token_rewards

    mask = torch.tensor([[1.0, 1, 1, 0], [1, 0, 0, 0]])
    r = _token_rewards(torch.tensor([1.0, 2.0]), mask, None)
    assert r.tolist() == [[0, 0, 1, 0], [2, 0, 0, 0]]
    kl = torch.full_like(mask, 0.1) * mask
    assert torch.allclose(_token_rewards(torch.tensor([1.0, 2.0]), mask, kl).sum(-1), torch.tensor([0.7, 1.9]))
