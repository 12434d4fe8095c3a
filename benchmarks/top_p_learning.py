"""Does truncated sampling learn as well as the full distribution? The quickstart's job over seeds, at
`rollout.top_p` 1.0 and at a truncated top_p, in one run (the two interleaved per seed).

    source launch/env.sh && python benchmarks/top_p_learning.py                     # seeds 1-5, top_p 0.8
    python benchmarks/top_p_learning.py --seeds 1 2 3 --top-p 0.9 -- trainer.steps=60   # overrides for all

Each (seed, top_p) runs `launch/train.sh examples/grpo_cpu_tiny.yaml` (its 2 ranks, its validation: greedy
accuracy on the 5 held-out sums every 20 steps) into <out>/p<top_p>_s<seed>/. Per run: the held-out greedy
accuracy at the last validation and its best, the training reward over the last 10 steps (sampled at that
run's top_p: not comparable across top_p, a truncated sampler scores higher on the same policy), and the
policy entropy under the distribution each token was sampled from (first and last 10 steps). Prints a
Markdown table and the per-top_p means and ranges; writes <out>/results.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ACC = "val/arithmetic/accuracy"


def run(run_dir: Path, seed: int, top_p: float, extra: list[str]) -> list[dict]:
    """One training run -> its metrics rows (a finished run already there is read, not rerun)."""
    metrics = run_dir / "metrics.jsonl"
    if not (run_dir / "final_model").is_dir():
        overrides = [f"trainer.seed={seed}", f"rollout.top_p={top_p}", f"trainer.run_dir={run_dir}"]
        overrides += ["logging.wandb.mode=disabled", "checkpoint.every=0", *extra]
        with open(run_dir.parent / f"{run_dir.name}.log", "w") as log:
            cmd = ["bash", str(ROOT / "launch" / "train.sh"), "examples/grpo_cpu_tiny.yaml", *overrides]
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT).returncode
        if rc != 0:
            sys.exit(f"top_p {top_p} seed {seed} failed (exit {rc}): see {run_dir.parent / run_dir.name}.log")
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def summary(rows: list[dict]) -> dict[str, float]:
    val = [r[ACC] for r in rows if ACC in r]
    train = [r for r in rows if "reward/mean" in r]
    mean = lambda xs: sum(xs) / max(len(xs), 1)  # noqa: E731
    return {
        "val_last": val[-1],
        "val_best": max(val),
        "reward_last10": mean([r["reward/mean"] for r in train[-10:]]),
        "entropy_first10": mean([r["actor/entropy"] for r in train[:10]]),
        "entropy_last10": mean([r["actor/entropy"] for r in train[-10:]]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    ap.add_argument("--top-p", type=float, default=0.8)
    ap.add_argument("--out", default="runs/bench_top_p_learning")
    ap.add_argument("overrides", nargs="*", help="config overrides for every run (after --)")
    args = ap.parse_args()
    out = ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for seed in args.seeds:
        for top_p in (1.0, args.top_p):
            name = f"p{top_p:g}_s{seed}"
            results[name] = {"seed": seed, "top_p": top_p, **summary(run(out / name, seed, top_p, args.overrides))}
            print(name, json.dumps({k: round(v, 4) for k, v in results[name].items()}), flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    keys = ("val_last", "val_best", "reward_last10", "entropy_first10", "entropy_last10")
    print("\n| top_p | seed | " + " | ".join(keys) + " |\n|---|---|" + "---|" * len(keys))
    for r in results.values():
        print(f"| {r['top_p']:g} | {r['seed']} | " + " | ".join(f"{r[k]:.3f}" for k in keys) + " |")
    for top_p in (1.0, args.top_p):
        group = [r for r in results.values() if r["top_p"] == top_p]
        cells = []
        for k in keys:
            xs = [r[k] for r in group]
            cells.append(f"{k} {sum(xs) / len(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})")
        print(f"\ntop_p {top_p:g}, {len(group)} seeds: " + "; ".join(cells))


if __name__ == "__main__":
    main()
