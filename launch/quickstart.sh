#!/usr/bin/env bash
# Installs into .venv (first time only) and trains GRPO on the offline arithmetic task: a tiny
# char-level Llama, 2 CPU ranks under the deepspeed launcher, W&B offline. Rollouts follow
# rollout.engine: auto (HF generate for this 330k model on CPU); pass rollout.engine=vllm for vLLM.
# Expected on 2 cores: ~8 s start-up, then ~0.1-0.2 s a step for 120 steps; reward/mean rises from
# ~0.02 to ~0.75-0.95 over the last 10 steps (docs/BENCHMARKS.md).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source launch/env.sh
run_dir="${RUN_DIR:-runs/quickstart}"
bash launch/train.sh examples/grpo_cpu_tiny.yaml trainer.run_dir="$run_dir" "$@"
python - "$run_dir" <<'PY'
import json, sys
allrows = [json.loads(l) for l in open(f"{sys.argv[1]}/metrics.jsonl")]
rows = [r for r in allrows if "reward/mean" in r]
first = sum(r["reward/mean"] for r in rows[:5]) / min(5, len(rows))
last = sum(r["reward/mean"] for r in rows[-10:]) / min(10, len(rows))
print(f"reward/mean: first 5 steps {first:.3f} -> last 10 steps {last:.3f} over {len(rows)} steps")
val = [(r["step"], r[k]) for r in allrows for k in r if k.startswith("val/") and k.endswith("/accuracy")]
if val:
    print("validation accuracy (held-out prompts, greedy): " + ", ".join(f"step {s}: {v:.2f}" for s, v in val))
print(f"metrics: {sys.argv[1]}/metrics.jsonl  curve: {sys.argv[1]}/reward_curve.png  "
      f"W&B offline run: {sys.argv[1]}/wandb  model: {sys.argv[1]}/final_model")
PY
