"""Partial rollouts against the synchronous step on a long-tail job, in one interleaved run; prints a
Markdown table and the partial / synchronous ratios.

    source launch/env.sh && python benchmarks/partial_rollouts.py [--rounds 2] [--steps 6]

The job is the real-model demo's (`examples/grpo_cpu_smollm2_rg.yaml`: SmolLM2-135M-Instruct, 8
prompts x 8 samples, made by `bash launch/demo.sh` once) with room to answer
(`rollout.max_new_tokens` 96): most answers are short, a few run long, and the synchronous step
generates until its longest sample ends. Both cells use the truncated importance weight
(`algorithm.tis_cap` 2), so they differ only in `rollout.partial`. The cells alternate within each
round (this host's speed drifts); per cell the mean over steps 2.. (step 1 fills the pool) of the
step and of generation, the model tokens trained per second, and the trained tokens' staleness.
Writes <out>/results.json. Run nothing else meanwhile.
"""

from __future__ import annotations

import argparse
import json
import statistics

from demo_job import ROOT, require_model, train_demo

LONG_TAIL = ["rollout.max_new_tokens=96", "rollout.max_model_len=192", "algorithm.tis_cap=2.0"]
CELLS = {
    "synchronous": [],
    "partial": [
        "rollout.partial.enabled=true",
        "rollout.partial.max_staleness=1",
        "rollout.partial.over_provision=1.0",
        "rollout.partial.chunk_tokens=24",
    ],
}


def cell_summary(rows: list[dict], prompts: int, n: int) -> dict:
    timed = rows[1:]
    step = statistics.mean(r["timing_s/step"] for r in timed)
    tokens = statistics.mean(r["response_length/mean"] for r in timed) * prompts * n
    return {
        "step_s": step,
        "gen_s": statistics.mean(r["timing_s/gen"] for r in timed),
        "response_tokens": statistics.mean(r["response_length/mean"] for r in timed),
        "tokens_per_s": tokens / step,
        "staleness": statistics.mean(r.get("partial/staleness/mean", 0.0) for r in timed),
        "reward": statistics.mean(r["reward/mean"] for r in rows),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--steps", type=int, default=6, help="per run; the first is not timed")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="runs/bench_partial")
    args = ap.parse_args()
    require_model()
    out = ROOT / args.out
    results = []
    for rnd in range(args.rounds):
        for name, overrides in CELLS.items():
            rows = train_demo(out / f"r{rnd}_{name}", [*LONG_TAIL, *overrides], args.steps, args.seed)
            results.append({"round": rnd, "cell": name, **cell_summary(rows, 8, 8)})
            print(json.dumps(results[-1]), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print("\n| round | cell | step s | generation s | response tokens | tokens trained/s | staleness | reward |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['round']} | {r['cell']} | {r['step_s']:.2f} | {r['gen_s']:.2f} | {r['response_tokens']:.1f} "
            f"| {r['tokens_per_s']:.1f} | {r['staleness']:.2f} | {r['reward']:.3f} |"
        )
    for rnd in range(args.rounds):
        sync, part = (next(x for x in results if x["round"] == rnd and x["cell"] == c) for c in CELLS)
        print(
            f"round {rnd}: partial / synchronous step {part['step_s'] / sync['step_s']:.2f}x, generation "
            f"{part['gen_s'] / sync['gen_s']:.2f}x, tokens trained/s {part['tokens_per_s'] / sync['tokens_per_s']:.2f}x"
        )


if __name__ == "__main__":
    main()
