"""Partial rollouts against the synchronous step on a long-tail job, in one interleaved run; prints a
Markdown table and the partial / synchronous ratios.

    source launch/env.sh && python benchmarks/partial_rollouts.py [--rounds 2] [--steps 6]

The job is the real-model demo's (`examples/grpo_cpu_smollm2_rg.yaml`: SmolLM2-135M-Instruct, 8
prompts x 8 samples, made by `bash launch/demo.sh` once) with room to answer
(`rollout.max_new_tokens` 96, `--new-tokens`): most answers are short, a few run long, and the
synchronous step generates until its longest sample ends. Both cells use the truncated importance weight
(`algorithm.tis_cap` 2), so they differ only in `rollout.partial`. The cells alternate within each
round (this host's speed drifts); per cell the mean over steps 2.. (step 1 fills the pool) of the
step and of generation, the decode steps (the engine's forward passes: the longest sample of a
synchronous step, each round's longest output added up for partial rollouts; a decode-bound GPU
engine's generation time follows them, a CPU's follows the tokens), the response lengths, the model
tokens trained per second, and the trained tokens' staleness.
Writes <out>/results.json. Run nothing else meanwhile.
"""

from __future__ import annotations

import argparse
import json
import statistics

from demo_job import ROOT, require_model, train_demo

CELLS = {"synchronous": [], "partial": ["rollout.partial.enabled=true"]}
PHASES = ("gen", "ref", "update_actor", "update_weights")


def long_tail(new_tokens: int) -> list[str]:
    """Room to answer (data.max_prompt_length 96 + a full answer); rounds of a quarter of it."""
    return [
        f"rollout.max_new_tokens={new_tokens}",
        f"rollout.max_model_len={96 + new_tokens}",
        f"rollout.partial.chunk_tokens={new_tokens // 4}",
        "algorithm.tis_cap=2.0",
    ]


def cell_summary(rows: list[dict], prompts: int, n: int) -> dict:
    timed = rows[1:]
    step = statistics.mean(r["timing_s/step"] for r in timed)
    tokens = statistics.mean(r["response_length/mean"] for r in timed) * prompts * n
    # decode steps per step: the longest sample (synchronous) or each round's longest output, added up
    decode = [r.get("partial/decode_steps", r["response_length/max"]) for r in timed]
    return {
        "step_s": step,
        "gen_s": statistics.mean(r["timing_s/gen"] for r in timed),
        "decode_steps": statistics.mean(decode),
        "response_tokens": statistics.mean(r["response_length/mean"] for r in timed),
        "p90": statistics.mean(r["response_length/p90"] for r in timed),
        "max": statistics.mean(r["response_length/max"] for r in timed),
        "tokens_per_s": tokens / step,
        "staleness": statistics.mean(r.get("partial/staleness/mean", 0.0) for r in timed),
        "resent": statistics.mean(r.get("partial/resent_tokens", 0.0) for r in timed),
        # each phase's share of the step: what the same cut of generation is worth where phases differ
        "shares": {k: statistics.mean(r[f"timing_s/{k}"] / r["timing_s/step"] for r in timed) for k in PHASES},
        "reward": statistics.mean(r["reward/mean"] for r in rows),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--steps", type=int, default=6, help="per run; the first is not timed")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--staleness", type=int, default=1, help="rollout.partial.max_staleness")
    ap.add_argument("--over", type=float, default=1.0, help="rollout.partial.over_provision")
    ap.add_argument("--cells", nargs="+", default=list(CELLS), choices=list(CELLS))
    ap.add_argument("--out", default="runs/bench_partial")
    ap.add_argument("--set", nargs="*", default=[], help="more overrides for both cells (key=value)")
    args = ap.parse_args()
    require_model()
    out = ROOT / args.out
    results = []
    for rnd in range(args.rounds):
        for name in args.cells:
            overrides = CELLS[name]
            if name == "partial":
                overrides = [*overrides, f"rollout.partial.max_staleness={args.staleness}"]
                overrides.append(f"rollout.partial.over_provision={args.over}")
            job = [*long_tail(args.new_tokens), *args.set, *overrides]
            rows = train_demo(out / f"r{rnd}_{name}", job, args.steps, args.seed)
            results.append({"round": rnd, "cell": name, **cell_summary(rows, 8, 8)})
            print(json.dumps(results[-1]), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(
        "\n| round | cell | step s | generation s | decode steps | response tokens mean / p90 / max "
        "| tokens trained/s | staleness | re-sent tokens | gen / ref / update / sync share | reward |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        shares = " / ".join(f"{r['shares'][k]:.2f}" for k in PHASES)
        print(
            f"| {r['round']} | {r['cell']} | {r['step_s']:.2f} | {r['gen_s']:.2f} | {r['decode_steps']:.0f} "
            f"| {r['response_tokens']:.1f} / {r['p90']:.0f} / {r['max']:.0f} "
            f"| {r['tokens_per_s']:.1f} | {r['staleness']:.2f} | {r['resent']:.0f} "
            f"| {shares} | {r['reward']:.3f} |"
        )
    for rnd in range(args.rounds if len(args.cells) == 2 else 0):
        sync, part = (next(x for x in results if x["round"] == rnd and x["cell"] == c) for c in CELLS)
        ratio = {k: part[k] / sync[k] for k in ("step_s", "gen_s", "tokens_per_s", "decode_steps")}
        per_token = {k: ratio[k] * sync["response_tokens"] / part["response_tokens"] for k in ("gen_s", "decode_steps")}
        print(
            f"round {rnd}: partial / synchronous step {ratio['step_s']:.2f}x, generation {ratio['gen_s']:.2f}x "
            f"({per_token['gen_s']:.2f}x per trained token), tokens trained/s {ratio['tokens_per_s']:.2f}x, "
            f"decode steps {ratio['decode_steps']:.2f}x ({per_token['decode_steps']:.2f}x per trained token: "
            "what a decode-bound GPU's generation follows)"
        )


if __name__ == "__main__":
    main()
