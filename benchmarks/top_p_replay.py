"""Truncated sampling (top-k/top-p) scored as it was sampled, against scored over the whole vocabulary.

    source launch/env.sh && python benchmarks/top_p_replay.py --config examples/grpo_cpu_smollm2.yaml \\
        --steps 3 rollout.top_p=0.8

Two arms on the same job and seed, each in a process of its own (an in-process vLLM engine ends the
process group at shutdown): `kept`, verl-ds as it runs (every pass scores a token under the renormalised
set the engine sampled it from, `algos.TokenDist`), and `vocabulary`, the same run with the trainer's
passes scoring the whole vocabulary (what verl-ds did before, and what a trainer that ignores the
sampling set does). Prints, per arm, the medians over the steps of the rollout-vs-trainer numbers on
the same weights (`rollout_corr/*`: the gap, the IS weight mean, the clip-band share, the |log ratio|
quantiles) and writes <out>/results.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KEYS = (
    "logprob_abs_diff_mean",
    "is_weight_mean",
    "phantom_clip_fraction",
    "log_ratio_abs_p50",
    "log_ratio_abs_p95",
    "log_ratio_abs_p99",
    "log_ratio_abs_max",
    "seq_phantom_clip_fraction",
    "seq_log_ratio_abs_p99",
)


def run_arm(arm: str, config: str, steps: int, out: Path, overrides: list[str]) -> list[dict]:
    """One arm in this process: `steps` steps of the job -> each step's metrics."""
    from verl_ds import algos, preflight
    from verl_ds.config import load_config
    from verl_ds.trainer import setup
    from verl_ds.trainer.rl_trainer import RLTrainer

    if arm == "vocabulary":  # the trainer's passes score the whole vocabulary at the rollout's temperature
        real = preflight.resolve_sampled
        preflight.resolve_sampled = lambda cfg: algos.TokenDist(real(cfg).temperature)
        # the step's rows would read that gap as a sync that did not land: the probe (top_p 1) checks it
        setup.resolve_sync_check = lambda *args: "probe"
    cfg = load_config(config, [*overrides, f"trainer.run_dir={out / arm}", "logging.wandb.mode=disabled"])
    with RLTrainer(cfg) as trainer:
        return [trainer.step() for _ in range(steps)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="examples/grpo_cpu_smollm2.yaml")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default="runs/bench_top_p")
    ap.add_argument("--arm", help=argparse.SUPPRESS)  # internal: run one arm in this process
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    out = Path(a.out)
    if a.arm:
        rows = run_arm(a.arm, a.config, a.steps, out, a.overrides)
        (out / f"{a.arm}.json").write_text(json.dumps(rows))
        return
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for arm in ("kept", "vocabulary"):
        cmd = [sys.executable, __file__, "--arm", arm, "--config", a.config, "--steps", str(a.steps), "--out", a.out]
        subprocess.run([*cmd, *a.overrides], check=True, cwd=ROOT)
        rows = json.loads((out / f"{arm}.json").read_text())
        results[arm] = {k: statistics.median(r[f"rollout_corr/{k}"] for r in rows) for k in KEYS}
        results[arm]["reward_mean"] = statistics.mean(r["reward/mean"] for r in rows)
    (out / "results.json").write_text(json.dumps({"config": a.config, "overrides": a.overrides, **results}, indent=1))
    print(f"| arm | {' | '.join(KEYS)} | reward |")
    print("|---" * (len(KEYS) + 2) + "|")
    for arm, r in results.items():
        print(f"| {arm} | " + " | ".join(f"{r[k]:.3g}" for k in KEYS) + f" | {r['reward_mean']:.3f} |")


if __name__ == "__main__":
    main()
