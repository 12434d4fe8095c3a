"""Token budgets (padding-free micro-batches) against row micro-batches on the real-model demo's job,
measured in one interleaved run; prints a Markdown table of ratios.

    source launch/env.sh && python benchmarks/padding.py                       # max_new_tokens 24 and 96
    python benchmarks/padding.py --new-tokens 96 --rounds 2 --steps 4

The job is `examples/grpo_cpu_smollm2_rg.yaml` (SmolLM2-135M-Instruct, 8 prompts x 8 samples, made by
`bash launch/demo.sh` once) through `bash launch/train.sh` (the demo's layout: one rank x every core),
without validation. For each `rollout.max_new_tokens` (96: `rollout.max_model_len` raised to fit) up
to three cells: `before` (the defaults before token budgets: row micro-batches and plain SDPA,
`roles.*.max_tokens_per_micro_batch=0 model.attn_implementation=sdpa`), `rows` (row micro-batches
under today's attention) and `auto` (today's defaults); `eager` and `compiled` set
`rollout.enforce_eager` to true / false. The cells alternate within each round (this
host's speed drifts). Per cell: the median over steps 2.. (step 1 warms up) of the step, the actor
update, the reference pass and generation, mean response tokens, and the update's
`perf/padding_efficiency`; per round and `max_new_tokens`, each cell's step over the first cell's.
`--before-checkout DIR` runs the `before` cell with the code of another checkout instead (e.g. a git
worktree of the commit before token budgets, with its own `.venv`), on its own defaults. Writes
<out>/results.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
from math import nan
from pathlib import Path

from demo_job import ROOT, require_model, train_demo

PHASES = ("step", "update_actor", "ref", "gen")


ROWS = [f"roles.{r}.max_tokens_per_micro_batch=0" for r in ("actor", "reference")]
CELLS = {
    "before": [*ROWS, "model.attn_implementation=sdpa"],
    "rows": ROWS,
    "auto": [],
    "eager": ["rollout.enforce_eager=true"],
    "compiled": ["rollout.enforce_eager=false"],
}


def run_cell(run_dir: Path, new_tokens: int, cell: str, steps: int, seed: int, before: Path | None) -> list[dict]:
    """One training run of `steps` steps -> its metrics rows."""
    overrides = [
        f"rollout.max_new_tokens={new_tokens}",
        f"rollout.max_model_len={max(160, 96 + new_tokens)}",  # data.max_prompt_length 96 + a full answer
    ]
    if cell == "before" and before:
        return train_demo(run_dir, overrides, steps, seed, root=before)
    return train_demo(run_dir, [*overrides, *CELLS[cell]], steps, seed)


def summarize(rows: list[dict]) -> dict:
    timed = rows[1:]  # step 1 warms up (allocations, vLLM's first batches)
    med = {p: statistics.median(r[f"timing_s/{p}"] for r in timed) for p in PHASES}
    med["response_tokens"] = statistics.mean(r["response_length/mean"] for r in timed)
    med["truncated"] = statistics.mean(r["response/truncated_fraction"] for r in timed)
    for key, metric in (("update", "actor/update"), ("ref", "reference/score")):  # nan: code before the metric
        effs = [r.get(f"perf/padding_efficiency/{metric}", nan) for r in timed]
        med[f"{key}_padding_efficiency"] = statistics.mean(effs)
    return med


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--new-tokens", type=int, nargs="+", default=[24, 96])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4, help="per run; the first is not timed")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--cells", nargs="+", default=["before", "auto"], choices=list(CELLS), help="the first is the base")
    ap.add_argument("--out", default="runs/bench_padding")
    ap.add_argument("--before-checkout", type=Path, help="run the `before` cell with this checkout's code, as it is")
    args = ap.parse_args()
    require_model()
    out = ROOT / args.out
    results = []
    for rnd in range(args.rounds):
        for n in args.new_tokens:
            for cell in args.cells:
                run_dir = out / f"r{rnd}_new{n}_{cell}"
                res = {
                    "round": rnd,
                    "max_new_tokens": n,
                    "cell": cell,
                    **summarize(run_cell(run_dir, n, cell, args.steps, args.seed, args.before_checkout)),
                }
                results.append(res)
                print(json.dumps(res), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(
        "\n| max_new_tokens | micro-batches | mean response tokens | truncated | actor update s | reference s "
        f"| generation s | step s | update padding eff. | ref padding eff. | step / {args.cells[0]} |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        base = [
            x
            for x in results
            if x["round"] == r["round"] and x["max_new_tokens"] == r["max_new_tokens"] and x["cell"] == args.cells[0]
        ]
        ratio = f"{r['step'] / base[0]['step']:.2f}" if base and r["cell"] != args.cells[0] else ""
        print(
            f"| {r['max_new_tokens']} | {r['cell']} | {r['response_tokens']:.1f} "
            f"| {100 * r['truncated']:.0f}% | {r['update_actor']:.2f} | {r['ref']:.2f} | {r['gen']:.2f} "
            f"| {r['step']:.2f} "
            f"| {r['update_padding_efficiency']:.2f} | {r['ref_padding_efficiency']:.2f} | {ratio} |"
        )


if __name__ == "__main__":
    main()
