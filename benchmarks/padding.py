"""Token budgets (padding-free micro-batches) against row micro-batches on the real-model demo's job,
measured in one interleaved run; prints a Markdown table of ratios.

    source launch/env.sh && python benchmarks/padding.py                       # max_new_tokens 24 and 96
    python benchmarks/padding.py --new-tokens 96 --rounds 2 --steps 4

The job is `examples/grpo_cpu_smollm2_rg.yaml` (SmolLM2-135M-Instruct, 8 prompts x 8 samples, made by
`bash launch/demo.sh` once) through `bash launch/train.sh` (the demo's layout: one rank x every core),
without validation. For each `rollout.max_new_tokens` (96: `rollout.max_model_len` raised to fit) two
cells: `roles.*.max_tokens_per_micro_batch=0` (row micro-batches, the default before) and the
default `auto`. The cells alternate within each round (this host's speed drifts). Per cell: the median
over steps 2.. (step 1 warms up) of the step, the actor update, the reference pass and generation,
mean response tokens, and the update's `perf/padding_efficiency`; per round and `max_new_tokens`, the
auto / rows ratio of the step. Writes <out>/results.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from demo_job import ROOT, require_model, train_demo

PHASES = ("step", "update_actor", "ref", "gen")


def run_cell(run_dir: Path, new_tokens: int, budget: str, steps: int, seed: int) -> list[dict]:
    """One training run of `steps` steps -> its metrics rows."""
    overrides = [
        f"rollout.max_new_tokens={new_tokens}",
        f"rollout.max_model_len={max(160, 96 + new_tokens)}",  # data.max_prompt_length 96 + a full answer
        *[f"roles.{r}.max_tokens_per_micro_batch={budget}" for r in ("actor", "reference")],
    ]
    return train_demo(run_dir, overrides, steps, seed)


def summarize(rows: list[dict]) -> dict:
    timed = rows[1:]  # step 1 warms up (allocations, vLLM's first batches)
    med = {p: statistics.median(r[f"timing_s/{p}"] for r in timed) for p in PHASES}
    med["response_tokens"] = statistics.mean(r["response_length/mean"] for r in timed)
    med["truncated"] = statistics.mean(r["response/truncated_fraction"] for r in timed)
    med["update_padding_efficiency"] = statistics.mean(r["perf/padding_efficiency/actor/update"] for r in timed)
    med["ref_padding_efficiency"] = statistics.mean(r["perf/padding_efficiency/reference/score"] for r in timed)
    return med


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--new-tokens", type=int, nargs="+", default=[24, 96])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4, help="per run; the first is not timed")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--budgets", nargs="+", default=["0", "auto"], help="max_tokens_per_micro_batch values; 0 first")
    ap.add_argument("--out", default="runs/bench_padding")
    args = ap.parse_args()
    require_model()
    out = ROOT / args.out
    results = []
    for rnd in range(args.rounds):
        for n in args.new_tokens:
            for budget in args.budgets:
                run_dir = out / f"r{rnd}_new{n}_{budget}"
                res = {
                    "round": rnd,
                    "max_new_tokens": n,
                    "budget": budget,
                    **summarize(run_cell(run_dir, n, budget, args.steps, args.seed)),
                }
                results.append(res)
                print(json.dumps(res), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(
        "\n| max_new_tokens | micro-batches | mean response tokens | truncated | actor update s | reference s "
        "| generation s | step s | update padding eff. | ref padding eff. | step auto / rows |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        rows = [
            x
            for x in results
            if x["round"] == r["round"] and x["max_new_tokens"] == r["max_new_tokens"] and x["budget"] == "0"
        ]
        ratio = f"{r['step'] / rows[0]['step']:.2f}" if rows and r["budget"] != "0" else ""
        cell = "rows (0)" if r["budget"] == "0" else r["budget"]
        print(
            f"| {r['max_new_tokens']} | {cell} | {r['response_tokens']:.1f} "
            f"| {100 * r['truncated']:.0f}% | {r['update_actor']:.2f} | {r['ref']:.2f} | {r['gen']:.2f} "
            f"| {r['step']:.2f} "
            f"| {r['update_padding_efficiency']:.2f} | {r['ref_padding_efficiency']:.2f} | {ratio} |"
        )


if __name__ == "__main__":
    main()
