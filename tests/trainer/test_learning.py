"""The quickstart learns: a change that keeps every metric present and finite but breaks learning (a
flipped advantage sign, a learning rate that is ignored) fails here.

The quickstart's job (`examples/grpo_cpu_tiny.yaml`: a random-init 330k-parameter Llama learns
`a+b=`) in one process, its dtypes pinned to fp32, so each CPU kind runs the same arithmetic up to
its kernels' summation order. Its reward starts near 0 (a random model rarely writes the right
digit); fp32 runs of this job end between 0.7 and 1.0 (docs/BENCHMARKS.md: 13 seeds, 2 ranks). The
bounds leave room for another CPU kind's trajectory and stay far from what no learning gives.
"""

from pathlib import Path

from verl_ds.config import load_config
from verl_ds.trainer.rl_trainer import RLTrainer

ROOT = Path(__file__).resolve().parents[2]
STEPS = 120
FIRST_AT_MOST = 0.2  # mean reward of steps 1-5
LAST_AT_LEAST = 0.4  # mean reward of the last 10 steps


def test_the_quickstart_job_learns_to_add(tmp_path):
    cfg = load_config(
        ROOT / "examples" / "grpo_cpu_tiny.yaml",
        [
            f"trainer.steps={STEPS}",
            "trainer.val_every=0",
            "trainer.val_before_train=false",
            "checkpoint.every=0",
            "logging.sample_every=0",
            "logging.wandb.mode=disabled",
            "rollout.engine=hf",
            *[f"precision.{k}_dtype=fp32" for k in ("actor", "reference", "rollout", "buffer")],
            f"trainer.run_dir={tmp_path}",
        ],
        world_size=1,
    )
    rewards = []
    with RLTrainer(cfg) as trainer:
        for _ in range(STEPS):
            rewards.append(trainer.step()["reward/mean"])
    first, last = sum(rewards[:5]) / 5, sum(rewards[-10:]) / 10
    print(f"reward/mean: first 5 steps {first:.3f}, last 10 steps {last:.3f}")
    assert first <= FIRST_AT_MOST, f"a random-init model already scores {first:.3f}"
    assert last >= LAST_AT_LEAST, f"reward {first:.3f} -> {last:.3f} over {STEPS} steps: it did not learn"
