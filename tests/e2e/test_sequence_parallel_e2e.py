"""`trainer.sequence_parallel_size: 2` through the real launcher (2 CPU ranks, vLLM): a PPO step (actor,
critic, reference) with each row split over both ranks trains what the same step without SP trains.

Both runs generate the same rows (every rank its own prompts, same seeds); SP 1 trains each rank's rows
data-parallel, SP 2 joins them and splits each row along the sequence. The first step's losses and
gradient norms agree to fp32 rounding (summation order only); a row counted twice, a lost boundary token
or a gradient SP times too large moves them by far more."""

import math

import pytest

from tests.e2e.helpers import read_metrics, run_train

pytestmark = pytest.mark.e2e
JOB = [
    "trainer.steps=2",
    "trainer.prompts_per_step=4",
    "rollout.n=4",
    "rollout.max_new_tokens=6",
    "data.reward_fn=tests.e2e.helpers:length_reward",  # varied scores: a gradient from step 1
    "trainer.val_every=0",
    "trainer.val_before_train=false",
    "logging.wandb.mode=disabled",
    "roles.actor.zero_stage=3",
    "roles.critic.zero_stage=2",
    *[f"precision.{k}_dtype=fp32" for k in ("actor", "critic", "reference", "rollout", "buffer")],
]
SAME = [
    "reward/mean",
    "actor/pg_loss",
    "actor/entropy",
    "actor/grad_norm",
    "critic/vf_loss",
    "precision/critic/grad_norm",
    "rollout_corr/logprob_abs_diff_max",
]
# not compared: per-micro-batch means (`pg_clipfrac`, `ppo_kl`) weigh rows by the micro-batches they share,
# and SP 1 packs short rows into one micro-batch under its token budget where SP 2 runs one row each


ONE_ROW = [f"roles.{r}.micro_batch_size=1" for r in ("actor", "critic", "reference")]


def test_a_ppo_step_split_over_two_ranks_trains_what_the_unsplit_step_trains(tmp_path):
    """SP 2 is one switch on the example (its micro-batches of 64 rows become one row, or one pack of the
    rows sharing a prompt, said at start), and a checkpoint SP 1 wrote resumes under it: the step SP 2
    trains from SP 1's step-1 checkpoint is the step SP 1 trains next (the checkpoint does not depend on
    the SP size: ZeRO partitions over every rank either way; measured within 3e-8 relative)."""
    sp1 = run_train("ppo_cpu_tiny.yaml", tmp_path / "sp1", *JOB, *ONE_ROW, "checkpoint.every=1")
    one = read_metrics(tmp_path / "sp1")
    assert [r["step"] for r in one] == [1, 2]
    assert one[1]["actor/grad_norm"] > 0 and one[1]["precision/critic/grad_norm"] > 0, (
        "no gradient: the test would prove nothing"
    )
    assert "micro-batch is one row" not in sp1.stdout + sp1.stderr
    step1 = tmp_path / "sp1" / "checkpoints" / "step_1"
    sp2 = run_train(
        "ppo_cpu_tiny.yaml", tmp_path / "sp2", *JOB, "trainer.sequence_parallel_size=2", f"trainer.resume={step1}"
    )
    said = sp2.stdout + sp2.stderr
    assert "trainer.sequence_parallel_size 2: every role's micro-batch is one row" in said
    assert "was written at trainer.sequence_parallel_size 1, this run splits rows over 2" in said
    (two,) = read_metrics(tmp_path / "sp2")
    assert two["step"] == 2 and two["perf/shared_tokens/actor/update"] < 1  # packs of rows sharing prompts
    for key in SAME:
        assert math.isclose(two[key], one[1][key], rel_tol=1e-4, abs_tol=1e-6), (key, one[1][key], two[key])
