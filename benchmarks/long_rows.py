"""Long rows on one rank: the actor update's peak memory against the row length, and the floor the
process returns to between steps, on SmolLM2-135M-Instruct (the demo's model). Prints a Markdown table.

    source launch/env.sh && python benchmarks/long_rows.py                      # 1k 2k 4k 8k, 3 steps each
    python benchmarks/long_rows.py --lengths 4096 --steps 3 --set precision.enable_grad_checkpointing=false

The job is `examples/grpo_cpu_smollm2.yaml` (fp32 unless `--set precision...`; gradient checkpointing
on) through `bash launch/train.sh`, one rank x every core, on a data file of prompts cut to `L`
tokens (`data.max_prompt_length`: a prompt keeps its last L tokens) with 16 new tokens: 2 prompts x 2
samples = 4 rows of ~L tokens a step, every pass's micro-batch as the run's token budget makes it.
Per length: the update's and the reference pass's peak resident memory (`memory/<stage>/process/
rss_peak_mib`: the process's high-water mark, reset at each phase), the process's resident memory at
the end of each step (its floor), seconds per step and the update's share, the token budget each pass
ran. A run that dies (the OOM killer) is a row saying so. Writes <out>/results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = "examples/grpo_cpu_smollm2.yaml"
MODEL = ROOT / "runs/smollm2-135m-instruct"
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()


def write_data(path: Path, rows: int, tokens: int, seed: int = 0) -> None:
    """`rows` prompts of more than `tokens` tokens (a few hundred words of filler, then the question):
    `data.max_prompt_length` cuts each to its last `tokens`."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(rows):
            a, b = rng.randint(0, 20), rng.randint(0, 20)
            filler = " ".join(rng.choice(WORDS) for _ in range(tokens + 64))
            f.write(json.dumps({"prompt": f"{filler}\nWhat is {a} + {b}?", "answer": str(a + b)}) + "\n")


def run(run_dir: Path, length: int, steps: int, sets: list[str]) -> dict:
    data = run_dir.parent / f"prompts_{length}.jsonl"
    write_data(data, 8, length)
    args = [
        f"trainer.run_dir={run_dir}",
        f"trainer.steps={steps}",
        "trainer.val_every=0",
        "trainer.val_before_train=false",
        "trainer.prompts_per_step=2",
        "logging.wandb.mode=disabled",
        "logging.memory_every=1",
        "data.task=files",
        f"data.train_files=[{data}]",
        f"data.max_prompt_length={length}",
        "rollout.n=2",
        "rollout.max_new_tokens=16",
        f"rollout.max_model_len={length + 32}",
        "roles.actor.micro_batch_size=4",
        "roles.reference.micro_batch_size=4",
        *sets,
    ]
    rc, rows, tail = train_one_rank(ROOT, CONFIG, run_dir, args)
    return {"length": length, "rc": rc, "rows": rows, "tail": tail[-3:]}


def train_one_rank(
    root: Path, config: str, run_dir: Path, args: list[str], ranks: int = 1
) -> tuple[int, list[dict], list[str]]:
    """`bash launch/train.sh config args` from `root` as one rank x every core (or `ranks` ranks sharing
    them), into a fresh `run_dir`: (exit code, its metrics.jsonl rows, the output's last lines); the
    checkpoints and export removed."""
    env = {**os.environ, "NUM_RANKS": str(ranks)}
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // ranks)))
    shutil.rmtree(run_dir, ignore_errors=True)
    done = subprocess.run(["bash", "launch/train.sh", config, *args], cwd=root, env=env, capture_output=True, text=True)
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    for kept in ("checkpoints", "final_model"):
        shutil.rmtree(run_dir / kept, ignore_errors=True)
    return done.returncode, rows, (done.stdout + done.stderr).strip().splitlines()[-5:]


def mib(row: dict, key: str) -> float:
    return row.get(key, float("nan"))


def table(results: list[dict]) -> str:
    head = (
        "| row tokens | steps run | update peak RSS (MiB) | reference peak RSS (MiB) | RSS after each step (MiB) "
        "| s/step | update s |"
    )
    lines = [head, "|---|---|---|---|---|---|---|"]
    for r in results:
        rows = r["rows"]
        if not rows:
            lines.append(f"| {r['length']} | 0 (exit {r['rc']}) | | | | | |")
            continue
        up = max(mib(x, "memory/update/process/rss_peak_mib") for x in rows)
        ref = max(mib(x, "memory/score/process/rss_peak_mib") for x in rows)
        floors = ", ".join(f"{mib(x, 'memory/floor/process/rss_mib'):.0f}" for x in rows)
        step = sum(x["timing_s/step"] for x in rows[1:] or rows) / len(rows[1:] or rows)
        upd = sum(x["timing_s/update_actor"] for x in rows[1:] or rows) / len(rows[1:] or rows)
        done = f"{len(rows)}" + ("" if r["rc"] == 0 else f" (exit {r['rc']})")
        lines.append(f"| {r['length']} | {done} | {up:.0f} | {ref:.0f} | {floors} | {step:.1f} | {upd:.1f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--set", action="append", default=[], help="an override for every run (repeatable)")
    ap.add_argument("--out", type=Path, default=ROOT / "runs/bench_long_rows")
    a = ap.parse_args()
    if not (MODEL / "config.json").exists():
        sys.exit("the demo's model is missing: run `bash launch/demo.sh` once (it converts SmolLM2-135M-Instruct)")
    a.out.mkdir(parents=True, exist_ok=True)
    results = []
    for length in a.lengths:
        results.append(run(a.out / f"len{length}", length, a.steps, a.set))
        print(table(results[-1:]).splitlines()[-1], flush=True)
    (a.out / "results.json").write_text(json.dumps(results, indent=1))
    print(table(results))


if __name__ == "__main__":
    main()
