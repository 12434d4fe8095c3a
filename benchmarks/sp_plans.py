"""What fits, per row length: `debug memory --plan`'s best plan for Llama-3-8B GRPO (actor + reference, 8
prompts x 8 samples a step) on 8 x 80 GB GPUs, rows of 8k to 128k tokens. The analytic model and cost
model only (nothing runs); prints a Markdown table for docs/BENCHMARKS.md.

    python benchmarks/sp_plans.py
"""

from __future__ import annotations

from pathlib import Path

from verl_ds.config import load_config
from verl_ds.diagnostics.memory import load_shape
from verl_ds.diagnostics.memory import plan as P
from verl_ds.diagnostics.memory.estimate import GIB
from verl_ds.ds_config import render_ds_configs, run_precision

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "tests/diagnostics/data/llama3_8b_config.json"
BASE = [
    "data.train_files=[]",
    "data.task=arithmetic",
    "trainer.prompts_per_step=8",
    "rollout.n=8",
    "trainer.mini_batch_size=0",
]


def best(tokens: int, world: int = 8, gpu_gib: float = 80.0) -> tuple[P.Plan | None, int]:
    rows = [f"rollout.max_model_len={tokens}", "data.max_prompt_length=1024", f"rollout.max_new_tokens={tokens - 1024}"]
    cfg = load_config(ROOT / "examples/grpo_gpu_qwen05b.yaml", BASE + rows, world_size=world)
    shape = load_shape(str(MODEL))
    shapes = {"actor": shape, "reference": shape}
    plans = P.search(cfg, shapes, render_ds_configs(cfg, world, run_precision(cfg)), world, gpu_gib)
    return (plans[0] if plans else None), len(plans)


def main() -> None:
    print(
        "| row tokens | plans that fit | best: SP | ZeRO actor / reference | checkpointing | long-row tools "
        "| peak GiB (stage: dominant) | s/step (all-to-all, recompute) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for tokens in (8192, 16384, 32768, 65536, 131072):
        p, n = best(tokens)
        if p is None:
            print(f"| {tokens:,} | 0 | | | | | | |")
            continue
        a, r = p.roles["actor"], p.roles["reference"]
        za = f"Z{a.stage}" + (f" off:{a.offload}" if a.offload != "none" else "")
        zr = f"Z{r.stage}" + (f" off:{r.offload}" if r.offload != "none" else "")
        c = p.costs
        print(
            f"| {tokens:,} | {n} | {p.sp} | {za} / {zr} | {'on' if p.grad_checkpointing else 'off'} | "
            f"{P._long_rows(p)} | {p.peak / GIB:.1f} ({p.peak_stage}: {p.dominant}) | {p.cost_s:.1f} "
            f"({c['all_to_all']:.1f}, {c['recompute']:.1f}) |"
        )


if __name__ == "__main__":
    main()
