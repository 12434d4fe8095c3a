"""Rollout ranks apart against colocated ranks on the same job, the same launch size, in one interleaved
run (one round per seed); prints a Markdown table, the apart / colocated ratios and the seeds' spread.

    source launch/env.sh && python benchmarks/rollout_ranks.py [--seeds 1 2 3] [--steps 120] [--config ...]

Cells: `colocated` (2 ranks, each generating its prompts then training) and `apart` (the same 2 ranks: 1
trainer + 1 rollout rank, `trainer.rollout_ranks=1`). Both use the truncated importance weight
(`algorithm.tis_cap` 2, a no-op for colocated rows: their weights are the rollout's) and no validation
(the apart cell refuses it), so they differ only in placement. Per cell, over steps 2..: the step, the
model tokens trained per second (prompts x n rows' response tokens over the step), each side's idle
share (the trainer waiting for rows, `timing_s/rows_wait`; the rollout rank waiting for the trainer,
`timing_s/rollout_idle`), the sync (seconds on the trainer, bytes sent against the tensors' bytes), the
policy lag, and the reward over the last 10 steps (the learning, at equal samples). Writes
<out>/results.json. Run nothing else meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CELLS = {"colocated": [], "apart": ["trainer.rollout_ranks=1"]}
COMMON = [
    "algorithm.tis_cap=2.0",
    "trainer.val_every=0",
    "trainer.val_before_train=false",
    "logging.wandb.mode=disabled",
    "checkpoint.every=0",
]


def run_cell(config: str, run_dir: Path, overrides: list[str]) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK")}
    cmd = ["bash", "launch/train.sh", config, f"trainer.run_dir={run_dir}", *overrides]
    out = subprocess.run(cmd, cwd=ROOT, env={**env, "NUM_RANKS": "2"}, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{run_dir}: exit {out.returncode}\n{out.stderr[-3000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def summary(rows: list[dict], prompts: int, n: int) -> dict:
    timed = rows[1:]
    step = statistics.median(r["timing_s/step"] for r in timed)
    tokens = statistics.mean(r["response_length/mean"] for r in timed) * prompts * n

    apart = "timing_s/rows_wait" in timed[-1]

    def share(key: str) -> float:
        return statistics.mean(r.get(key, 0.0) / r["timing_s/step"] for r in timed)

    return {
        "step_s": step,
        "tokens_per_s": tokens / step,
        # colocated, the trainer waits out generation and the engine idles through the rest of the step
        "trainer_idle": share("timing_s/rows_wait") if apart else share("timing_s/gen"),
        "rollout_idle": share("timing_s/rollout_idle") if apart else 1 - share("timing_s/gen"),
        "sync_s": statistics.median(r.get("timing_s/update_weights", 0.0) for r in timed),
        "bytes_sent": statistics.mean(r.get("sync/bytes_sent", 0.0) for r in timed),
        "bytes_full": statistics.mean(r.get("sync/bytes_full", 0.0) for r in timed),
        "policy_lag": statistics.mean(r.get("rollout/policy_lag", 0.0) for r in timed),
        "reward_last10": statistics.mean(r["reward/mean"] for r in rows[-10:]),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="examples/grpo_cpu_tiny.yaml")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="one interleaved round each")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--out", default="runs/bench_rollout_ranks")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    out = Path(args.out)
    shape = [f"trainer.steps={args.steps}", f"trainer.prompts_per_step={args.prompts}", f"rollout.n={args.n}"]
    results: dict[str, list[dict]] = {c: [] for c in CELLS}
    for seed in args.seeds:
        for cell, extra in CELLS.items():  # alternating within a round: this host's speed drifts
            run = [*COMMON, *shape, f"trainer.seed={seed}", *extra, *args.overrides]
            results[cell].append(summary(run_cell(args.config, out / f"{cell}_{seed}", run), args.prompts, args.n))
    (out / "results.json").write_text(json.dumps(results, indent=1))
    keys = list(results["colocated"][0])
    print("| cell | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for cell, runs in results.items():
        for seed, r in zip(args.seeds, runs):
            print(f"| {cell} {seed} | " + " | ".join(f"{r[key]:.4g}" for key in keys) + " |")
    for k, seed in enumerate(args.seeds):
        a, c = results["apart"][k], results["colocated"][k]
        print(
            f"seed {seed}: apart / colocated step {a['step_s'] / c['step_s']:.2f}x, tokens/s "
            f"{a['tokens_per_s'] / c['tokens_per_s']:.2f}x, reward last 10 {a['reward_last10']:.3f} vs "
            f"{c['reward_last10']:.3f}, bytes sent / full {a['bytes_sent'] / max(a['bytes_full'], 1):.3f}"
        )
    for cell, runs in results.items():  # learning at equal samples, against the seeds' spread
        last = [r["reward_last10"] for r in runs]
        spread = f"seeds {min(last):.3f}-{max(last):.3f}"
        print(f"{cell}: reward over the last 10 steps {statistics.mean(last):.3f} ({spread})")


if __name__ == "__main__":
    main()
