"""The real-model demo's job as the benchmarks run it: `examples/grpo_cpu_smollm2_rg.yaml`
(SmolLM2-135M-Instruct, made by `bash launch/demo.sh` once) through `bash launch/train.sh` (one rank
x every core), without validation or memory accounting. A run keeps its metrics, not its checkpoint
and exported model."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = "examples/grpo_cpu_smollm2_rg.yaml"


def require_model() -> None:
    if not (ROOT / "runs/smollm2-135m-instruct/config.json").exists():
        sys.exit("the demo's model is missing: run `bash launch/demo.sh` once (it converts SmolLM2-135M-Instruct)")


def train_demo(run_dir: Path, overrides: list[str], steps: int, seed: int, root: Path = ROOT) -> list[dict]:
    """One run of `steps` steps with `overrides` -> its metrics rows (the script exits on a failure).
    `root`: the checkout whose `launch/train.sh` runs it (another one: the code of another commit)."""
    args = [
        f"trainer.run_dir={run_dir}",
        f"trainer.steps={steps}",
        f"trainer.seed={seed}",
        "trainer.val_every=0",
        "trainer.val_before_train=false",
        "logging.wandb.mode=disabled",
        "logging.memory_every=0",
        *overrides,
    ]
    env = {**os.environ, "NUM_RANKS": os.environ.get("NUM_RANKS", "1")}
    env.setdefault("OMP_NUM_THREADS", str(os.cpu_count()))
    done = subprocess.run(["bash", "launch/train.sh", CONFIG, *args], cwd=root, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{run_dir}: training failed\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for kept in ("checkpoints", "final_model"):  # ~4.5 GB a run that no benchmark reads back
        shutil.rmtree(run_dir / kept, ignore_errors=True)
    return rows
