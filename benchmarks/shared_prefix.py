"""Shared prefixes on long prompts: the scoring and update seconds of a step with and without prefix sharing,
on SmolLM2-135M-Instruct (the demo's model). Prints a Markdown table with ratios against the first cell.

    source launch/env.sh && python benchmarks/shared_prefix.py                  # 1k-token prompts, 3 steps a cell
    python benchmarks/shared_prefix.py --lengths 1024 4096 --steps 2 --base 0123abc   # + the code at a commit
    python benchmarks/shared_prefix.py --config examples/grpo_cpu_smollm2_tools.yaml --steps 3   # a job as it is
    python benchmarks/shared_prefix.py --config examples/grpo_cpu_tiny_long_sp.yaml --ranks 2   # 8k-token rows, SP 2

The job is `examples/grpo_cpu_smollm2.yaml` as it is (fp32, gradient checkpointing on) through `bash
launch/train.sh`, one rank x every core, `trainer.prompts_per_step=1 rollout.n=8 rollout.max_new_tokens=16`,
on a data file of few-shot prompts: solved sums up to ~L tokens, then the question. Cells: `plain`
(`model.share_prompt=false`: every row runs its prompt), `shared` (the default: each micro-batch's shared
prefix once, `roles/prefix.py`), and with `--base REF` `before`: the code at REF (a git worktree, its own
defaults) on the same job. Per cell, the median over the steps after the first: the update's, the reference's
and the step's seconds, the update's peak resident memory (`memory/update/process/rss_peak_mib`), and
`perf/shared_tokens/actor/update` (tokens run / tokens the rows hold). `--config X`: that job on its own
data instead (the length column then reads 0), e.g. the tool job, whose episodes share their prompt and
what they share after it; `--ranks 2` runs it on 2 ranks (a sequence-parallel job: each shared pack split
over the group, `roles/sequence_parallel.py`). Writes <out>/results.json.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from long_rows import train_one_rank  # noqa: E402  (this folder: the script's own)

ROOT = Path(__file__).resolve().parent.parent
CONFIG = "examples/grpo_cpu_smollm2.yaml"
MODEL = ROOT / "runs/smollm2-135m-instruct"


def write_data(path: Path, rows: int, words: int, seed: int = 0) -> None:
    """`rows` few-shot prompts: solved sums (`a + b = c`, ~8 tokens each) up to ~`words` tokens, then the
    question; `data.max_prompt_length` keeps the last L tokens."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(rows):
            shots = []
            for _ in range(words // 8 + 8):
                a, b = rng.randint(0, 99), rng.randint(0, 99)
                shots.append(f"{a} + {b} = {a + b}")
            a, b = rng.randint(0, 20), rng.randint(0, 20)
            f.write(json.dumps({"prompt": "\n".join(shots) + f"\nWhat is {a} + {b}?", "answer": str(a + b)}) + "\n")


def run(root: Path, config: str, run_dir: Path, length: int, steps: int, sets: list[str], ranks: int = 1) -> list[dict]:
    args = [
        f"trainer.run_dir={run_dir}",
        f"trainer.steps={steps}",
        "trainer.val_every=0",
        "trainer.val_before_train=false",
        "logging.wandb.mode=disabled",
        "logging.memory_every=1",
    ]
    if length:  # the few-shot job
        args.append(f"model.path={MODEL}")
        data = run_dir.parent / f"prompts_{length}.jsonl"
        write_data(data, 8, length)
        args += ["trainer.prompts_per_step=1", "data.task=files", f"data.train_files=[{data}]"]
        args += [f"data.max_prompt_length={length}", "rollout.n=8", "rollout.max_new_tokens=16"]
        args += [f"rollout.max_model_len={length + 32}"]
    rc, rows, tail = train_one_rank(root, config, run_dir, args + sets, ranks)
    if rc or not rows:
        print("\n".join(tail), file=sys.stderr)
    return rows


def median(rows: list[dict], key: str) -> float:
    vals = [r[key] for r in rows[1:] or rows if key in r]
    return statistics.median(vals) if vals else float("nan")


COLUMNS = {
    "update s": "timing_s/update_actor",
    "reference s": "timing_s/ref",
    "step s": "timing_s/step",
    "update peak RSS MiB": "memory/update/process/rss_peak_mib",
    "tokens run / held (update)": "perf/shared_tokens/actor/update",
}


def table(results: list[dict]) -> str:
    lines = ["| prompt tokens | cell | " + " | ".join(COLUMNS) + " | update + reference vs first |"]
    lines.append("|---" * (len(COLUMNS) + 3) + "|")
    first: dict[int, float] = {}
    for r in results:
        vals = {c: median(r["rows"], k) for c, k in COLUMNS.items()}
        work = vals["update s"] + vals["reference s"]
        base = first.setdefault(r["length"], work)
        cells = " | ".join(f"{v:.3g}" for v in vals.values())
        lines.append(f"| {r['length']} | {r['cell']} | {cells} | {work / base:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024])
    ap.add_argument("--config", help="a job as it is, on its own data (instead of the few-shot prompts)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=1, help="ranks of the job (a sequence-parallel --config: its SP size)")
    ap.add_argument("--cells", nargs="+", default=["plain", "shared"], choices=["plain", "shared", "before"])
    ap.add_argument("--base", help="a git ref: adds the cell `before`, the code at that commit on the same job")
    ap.add_argument("--set", action="append", default=[], help="an override for every cell (repeatable)")
    ap.add_argument("--out", type=Path, default=ROOT / "runs/bench_shared_prefix")
    a = ap.parse_args()
    if not a.config and not (MODEL / "config.json").exists():
        sys.exit("the demo's model is missing: run `bash launch/demo.sh` once (it converts SmolLM2-135M-Instruct)")
    a.out = a.out.resolve()  # the `before` cell runs from its worktree
    a.out.mkdir(parents=True, exist_ok=True)
    cells = (["before"] if a.base else []) + [c for c in a.cells if c != "before"]
    roots = {"plain": ROOT, "shared": ROOT}
    if a.base:  # the same venv (install.sh's stamp matches), the commit's code first on the path
        roots["before"] = a.out / "base"
        shutil.rmtree(roots["before"], ignore_errors=True)
        subprocess.run(["git", "worktree", "prune"], cwd=ROOT, check=True)
        subprocess.run(["git", "worktree", "add", "--detach", str(roots["before"]), a.base], cwd=ROOT, check=True)
        (roots["before"] / ".venv").symlink_to(ROOT / ".venv")
    sets = {"plain": ["model.share_prompt=false"], "shared": ["model.share_prompt=true"], "before": []}
    results = []
    for length in [0] if a.config else a.lengths:
        for cell in cells:
            out = a.out / f"{cell}{length}"
            rows = run(roots[cell], a.config or CONFIG, out, length, a.steps, sets[cell] + a.set, a.ranks)
            results.append({"length": length, "cell": cell, "rows": rows})
            print(table(results).splitlines()[-1], flush=True)
    (a.out / "results.json").write_text(json.dumps(results, indent=1))
    print(table(results))


if __name__ == "__main__":
    main()
