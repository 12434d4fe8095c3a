#!/usr/bin/env bash
# One-GPU check (< 8 min), for a GPU machine without registry access: a few GRPO steps with a bf16
# actor and with an fp16 actor (dynamic loss scaling), world size 1, NCCL; prints loss scale /
# overflow / skipped steps, per-stage CUDA memory and the actor update's MFU (against the bf16 matmul
# rate measured here). DeepSpeed (pure Python) and wandb may travel as wheels in ./wheels; vLLM is
# used when importable, else HF generate.
#   bash launch/gpu_check.sh            results: runs/gpu_check/{bf16,fp16}/metrics.jsonl + summary
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" WANDB_SILENT=true HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
PY="${PYTHON:-python3}"
if ! "$PY" -c "import deepspeed" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --find-links wheels deepspeed
fi
engine=hf
"$PY" -c "import vllm" 2>/dev/null && engine=vllm
out=runs/gpu_check
mkdir -p "$out"
# a ~100M-parameter random-init Llama: large enough that the update is GPU work, built offline
common=(rollout.engine=$engine model.tiny.hidden=1024 model.tiny.layers=8 model.tiny.heads=16
        model.tiny.ffn=4096 trainer.steps=6 trainer.prompts_per_step=32 rollout.n=16
        roles.actor.micro_batch_size=128 roles.reference.micro_batch_size=256 logging.wandb.mode=disabled
        checkpoint.keep_last=1 rollout.gpu_memory_utilization=0.3 precision.rollout_dtype=bf16)
for dtype in bf16 fp16; do
  echo "== actor $dtype, rollout $engine"
  timeout 200 "$PY" -m deepspeed.launcher.runner --num_gpus 1 --master_port $((29500 + RANDOM % 1000)) \
    --module verl_ds.cli train --config examples/grpo_cpu_tiny.yaml "${common[@]}" \
    precision.actor_dtype=$dtype precision.reference_dtype=$dtype trainer.run_dir=$out/$dtype \
    2>&1 | grep -vE "it/s|^\s*$" | tail -n 15
done
"$PY" - "$out" <<'PY'
import json, sys, time
import torch
out = sys.argv[1]
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
torch.cuda.synchronize(); t0 = time.perf_counter()
for _ in range(20):
    a @ a
torch.cuda.synchronize()
peak = 20 * 2 * 8192**3 / (time.perf_counter() - t0)
print(f"bf16 matmul (measured): {peak / 1e12:.0f} TFLOP/s on {torch.cuda.get_device_name()}")
for dtype in ("bf16", "fp16"):
    try:
        rows = [json.loads(l) for l in open(f"{out}/{dtype}/metrics.jsonl")]
    except FileNotFoundError:
        print(f"{dtype}: no metrics (run failed)"); continue
    params = sum(p.numel() for p in __import__("safetensors.torch", fromlist=["load_file"]).load_file(
        f"{out}/{dtype}/init_model/model.safetensors").values())
    last = rows[-1]
    tokens = last["perf/throughput"] * last["timing_s/step"]          # prompt + response tokens of the step
    flops = 6 * params * tokens * 2                                   # fwd+bwd, 2 PPO epochs (the example's)
    mfu = flops / last["timing_s/update_actor"] / peak
    print(f"{dtype}: steps {len(rows)}, reward {last['reward/mean']:.3f}, step {last['timing_s/step']:.2f} s, "
          f"update {last['timing_s/update_actor']:.2f} s, MFU {100 * mfu:.1f}%, "
          f"loss_scale {last.get('precision/actor/loss_scale')}, overflow {last.get('precision/actor/overflow')}, "
          f"skipped {last.get('precision/actor/skipped_steps')}, rollout gap max "
          f"{last['rollout_corr/logprob_abs_diff_max']:.2e}")
    mem = {k: round(v) for k, v in last.items() if k.startswith("memory/") and "process/cuda_peak" in k}
    print(f"  per-stage CUDA peak MiB: {mem}")
PY
