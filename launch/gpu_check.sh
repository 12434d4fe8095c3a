#!/usr/bin/env bash
# One-GPU check (< 8 min), for a GPU machine without registry access: a few GRPO steps with a bf16
# actor, an fp16 actor (dynamic loss scaling), a ZeRO-3 actor asleep while vLLM generates, an int8
# reward model and long rows (4k-token prompts, gradient checkpointing, shared prefixes under FlexAttention,
# TiledMLP), each weight sync read back and probed (one `CHECK PASS|FAIL` line each), world size 1, NCCL, under DeepSpeed's per-node
# launcher (verl_ds.launcher --gpus: the first GPU CUDA_VISIBLE_DEVICES names, else GPU 0); prints loss scale / overflow / skipped steps, per-stage CUDA memory and the actor
# update's MFU (against the bf16 matmul rate measured here), then `verl-ds bench step` (per-phase
# time against a plain-PyTorch floor on the same GPU). DeepSpeed (pure Python) and its missing
# dependencies may travel as wheels in ./.whl (launch/gpu_wheels.sh); vLLM is used when importable,
# else HF generate.
#   bash launch/gpu_check.sh        results: runs/gpu_check/{bf16,fp16}/metrics.jsonl, *.log, summary.txt
# GPU_CHECK_SMALL=1 shrinks the job so the script itself can be tried on a CPU machine.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" WANDB_SILENT=true HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
if ! "$PY" -c "import deepspeed" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "gpu_check: could not install the wheels in .whl"; exit 1; }
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
engine=hf
"$PY" -c "import vllm" 2>/dev/null && engine=vllm
out=runs/gpu_check
ranks=(--num_ranks 1)  # GPU_CHECK_SMALL on a CPU machine: one CPU rank
"$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" && ranks=(--gpus --num_ranks 1)
rm -rf "$out" && mkdir -p "$out"
"$PY" -c "import torch, transformers, deepspeed; print('torch', torch.__version__, '| transformers', transformers.__version__,
'| deepspeed', deepspeed.__version__, '|', torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
# a ~100M-parameter random-init Llama: large enough that the update is GPU work, built offline
size=(model.tiny.hidden=1024 model.tiny.layers=8 model.tiny.heads=16 model.tiny.ffn=4096 trainer.prompts_per_step=32
      roles.actor.micro_batch_size=128 roles.reference.micro_batch_size=256)
steps=6
[[ -n "${GPU_CHECK_SMALL:-}" ]] && { size=(trainer.prompts_per_step=4 rollout.n=4 roles.actor.micro_batch_size=8); steps=2; engine=hf; }
common=(rollout.engine=$engine "${size[@]}" trainer.steps=$steps logging.wandb.mode=disabled logging.memory_every=1
        checkpoint.keep_last=1 rollout.gpu_memory_utilization=0.3 precision.rollout_dtype=bf16)
# the bf16 run samples as rollout.enforce_eager auto does on a GPU (torch.compile + CUDA graphs, its
# syncs read back from the captured engine); the later runs stay eager to keep the check's budget
eager=(rollout.enforce_eager=true)
for dtype in bf16 fp16; do
  mode=() limit=210; [ "$dtype" = fp16 ] && mode=("${eager[@]}") limit=150
  echo "== actor $dtype, rollout $engine"
  timeout $limit "$PY" -m verl_ds.launcher "${ranks[@]}" --master_port $((29500 + RANDOM % 1000)) -- \
    --module verl_ds.cli train --config examples/grpo_cpu_tiny.yaml "${common[@]}" \
    precision.actor_dtype=$dtype precision.reference_dtype=$dtype trainer.run_dir=$out/$dtype "${mode[@]}" \
    > "$out/$dtype.log" 2>&1
  echo "exit $? after ${SECONDS}s"; grep -vE "it/s|^\s*$" "$out/$dtype.log" | tail -n 12
done
# roles.actor.sleep at ZeRO-3: the actor's weights, gradients (DeepSpeed offload_states), masters and
# AdamW states (ds_internals.offload_states) leave the GPU while the rollout generates and come back
# before its update: memory/rollout/actor/* shows it
echo "== actor bf16 asleep during generation (roles.actor.sleep), rollout $engine"
timeout 150 "$PY" -m verl_ds.launcher "${ranks[@]}" --master_port $((29500 + RANDOM % 1000)) -- \
  --module verl_ds.cli train --config examples/grpo_cpu_tiny.yaml "${common[@]}" "${eager[@]}" roles.actor.zero_stage=3 \
  roles.actor.sleep=true precision.actor_dtype=bf16 precision.reference_dtype=bf16 trainer.run_dir=$out/sleep \
  > "$out/sleep.log" 2>&1
echo "exit $? after ${SECONDS}s"; grep -vE "it/s|^\s*$" "$out/sleep.log" | tail -n 6
# an int8 reward model (torchao weight-only, its own ZeRO-0 engine) scoring next to the bf16 actor: the
# bf16 run's random-init model as a sequence classifier; the actor and reference on packed rows
# (model.packing: varlen flash-attention where flash-attn is installed, else SDPA's masked pack)
echo "== int8 reward model, actor bf16 on packed rows, rollout $engine"
timeout 150 "$PY" -m verl_ds.launcher "${ranks[@]}" --master_port $((29500 + RANDOM % 1000)) -- \
  --module verl_ds.cli train --config examples/grpo_cpu_tiny.yaml "${common[@]}" "${eager[@]}" model.reward_path=$out/bf16/init_model \
  precision.reward_dtype=int8 roles.reward.ds_config=reward_zero0.json precision.actor_dtype=bf16 model.packing=true \
  precision.reference_dtype=bf16 trainer.run_dir=$out/int8_reward > "$out/int8_reward.log" 2>&1
echo "exit $? after ${SECONDS}s"; grep -vE "it/s|^\s*$" "$out/int8_reward.log" | tail -n 6
# long rows: 4k-token few-shot prompts x 4 samples (examples/prepare_long_rows.py), gradient checkpointing on,
# the 4 rows of a prompt sharing it (roles/prefix.py: FlexAttention's block mask on a GPU, SDPA's dense mask on
# a CPU), the actor's MLPs tiled (TiledMLP); memory/update/* against the start-up log's memory estimate
long=4096 attn=flex_attention
[[ -n "${GPU_CHECK_SMALL:-}" ]] && { long=512; attn=sdpa; }
"$PY" examples/prepare_long_rows.py "$out/long_rows.jsonl" --rows 8 --tokens $long > /dev/null
echo "== long rows ($long-token prompts), gradient checkpointing, shared prefixes ($attn), TiledMLP, rollout $engine"
timeout 150 "$PY" -m verl_ds.launcher "${ranks[@]}" --master_port $((29500 + RANDOM % 1000)) -- \
  --module verl_ds.cli train --config examples/grpo_cpu_tiny.yaml "${common[@]}" "${eager[@]}" \
  data.task=files data.train_files=[$out/long_rows.jsonl] data.max_prompt_length=$long rollout.max_model_len=$((long + 16)) \
  model.tiny.max_positions=$((long + 16)) trainer.prompts_per_step=2 rollout.n=4 roles.actor.micro_batch_size=4 \
  roles.reference.micro_batch_size=4 precision.enable_grad_checkpointing=true model.attn_implementation=$attn \
  roles.actor.tiled_mlp=true precision.actor_dtype=bf16 precision.reference_dtype=bf16 trainer.run_dir=$out/long_rows \
  > "$out/long_rows.log" 2>&1
echo "exit $? after ${SECONDS}s"; grep -E "shared prefixes|memory estimate|token budget" "$out/long_rows.log" | head -n 4
grep -vE "it/s|^\s*$" "$out/long_rows.log" | tail -n 4
# precision.batch_invariant: vLLM's batch-invariant kernels in the process (vllm_internals.batch_invariant_kernels), the
# rollout engine and the roles alike; every step scores a few rows again, each alone (trainer_corr/), which these
# kernels make bitwise equal to the step's own micro-batches
echo "== batch-invariant kernels (bf16 actor and rollout, rollout $engine)"
timeout 120 "$PY" -m verl_ds.launcher "${ranks[@]}" --master_port $((29500 + RANDOM % 1000)) -- \
  --module verl_ds.cli train --config examples/grpo_cpu_tiny.yaml "${common[@]}" "${eager[@]}" trainer.steps=3 \
  precision.batch_invariant=true logging.consistency_every=1 precision.actor_dtype=bf16 precision.reference_dtype=bf16 \
  trainer.run_dir=$out/batch_invariant > "$out/batch_invariant.log" 2>&1
echo "exit $? after ${SECONDS}s"; grep -vE "it/s|^\s*$" "$out/batch_invariant.log" | tail -n 4
echo "== bench step (bf16 actor, rollout $engine)"
timeout 110 "$PY" -m verl_ds.cli bench step --config examples/grpo_cpu_tiny.yaml --steps 3 "${common[@]}" "${eager[@]}" \
  precision.actor_dtype=bf16 precision.reference_dtype=bf16 trainer.run_dir=$out/bench > "$out/bench.log" 2>&1
echo "exit $?"; grep -E "^\||tokens/s|floor|params" "$out/bench.log" || tail -n 15 "$out/bench.log"
"$PY" - "$out" <<'PY' | tee "$out/summary.txt"
import json, sys
import torch
from safetensors.torch import load_file
from verl_ds.programs.bench_step import matmul_rate
out = sys.argv[1]
peak = matmul_rate("bf16", reps=20)
print(f"bf16 matmul (measured): {peak / 1e12:.1f} TFLOP/s on "
      f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU'}")
for dtype in ("bf16", "fp16"):
    try:
        rows = [r for r in map(json.loads, open(f"{out}/{dtype}/metrics.jsonl")) if "reward/mean" in r]
    except FileNotFoundError:
        print(f"{dtype}: no metrics (run failed)"); continue
    params = sum(p.numel() for p in load_file(f"{out}/{dtype}/init_model/model.safetensors").values())
    last = rows[-1]
    tokens = last["perf/throughput"] * last["timing_s/step"]          # prompt + response tokens of the step
    flops = 6 * params * tokens * 2                                   # fwd+bwd, 2 PPO epochs (the example's)
    mfu = flops / last["timing_s/update_actor"] / peak
    print(f"{dtype}: {params / 1e6:.1f}M params, steps {len(rows)}, reward {rows[0]['reward/mean']:.3f} -> "
          f"{last['reward/mean']:.3f}, step {last['timing_s/step']:.2f} s, update {last['timing_s/update_actor']:.2f} s, "
          f"MFU {100 * mfu:.1f}%, loss_scale {last.get('precision/actor/loss_scale')}, "
          f"overflow {last.get('precision/actor/overflow')}, skipped {last.get('precision/actor/skipped_steps')}, "
          f"rollout gap max {last.get('rollout_corr/logprob_abs_diff_max', float('nan')):.2e}")
    print("  timings:", {k[9:]: round(v, 3) for k, v in last.items() if k.startswith("timing_s/")})
    print("  process memory MiB:", {k[7:]: round(v) for k, v in last.items() if k.startswith("memory/") and "/process/" in k})
# one verdict line per check: what the first GPU run must show
def rows_of(run):
    try:
        return [r for r in map(json.loads, open(f"{out}/{run}/metrics.jsonl")) if "reward/mean" in r]
    except FileNotFoundError:
        return []
def verdict(name, ok, detail):
    print(f"CHECK {'PASS' if ok else 'FAIL'} {name}: {detail}")
for run, what in (("bf16", "bf16 actor"), ("fp16", "fp16 actor, dynamic loss scaling"), ("sleep", "ZeRO-3 actor asleep"),
                  ("int8_reward", "int8 reward model, packed rows")):
    rows = rows_of(run)
    last = rows[-1] if rows else {}
    finite = all(v == v for k, v in last.items() if isinstance(v, float) and not k.startswith("val/"))
    checked = last.get("rollout/sync_checked_params", 0)
    ok = len(rows) > 0 and finite and checked > 0
    extra = ""
    if run == "fp16":
        ok = ok and last.get("precision/actor/loss_scale", 0) >= 1
        extra = f", loss_scale {last.get('precision/actor/loss_scale')}"
    if run == "sleep" and torch.cuda.is_available():
        asleep = last.get("memory/rollout/actor/total_mib", float("nan")) < last.get("memory/update/actor/total_mib", 0)
        ok, extra = ok and asleep, f", actor MiB rollout/update {last.get('memory/rollout/actor/total_mib')}/" \
            f"{last.get('memory/update/actor/total_mib')}"
    if run == "int8_reward":
        packed = last.get("perf/padding_efficiency/actor/update")
        ok = ok and packed == 1.0
        extra = f", reward weight bytes {last.get('precision/reward/weight_bytes')}, actor update padding eff. {packed}"
    verdict(what, ok, f"{len(rows)} steps, all metrics finite: {finite}, sync read back {checked:.0f} params{extra}")
rows = rows_of("long_rows")  # long rows: shared prefixes under checkpointing, TiledMLP
last = rows[-1] if rows else {}
shared = last.get("perf/shared_tokens/actor/update", float("nan"))
finite = all(v == v for k, v in last.items() if isinstance(v, float) and not k.startswith("val/"))
verdict("long rows, checkpointing, shared prefixes, TiledMLP", len(rows) > 0 and finite and shared < 0.5,
        f"{len(rows)} steps, all metrics finite: {finite}, tokens run / held (update) {shared:.3f}, "
        f"update s {last.get('timing_s/update_actor', float('nan')):.2f}, actor MiB update "
        f"{last.get('memory/update/actor/total_mib', float('nan')):.0f}, process peak MiB update "
        f"{last.get('memory/update/process/rss_peak_mib', float('nan')):.0f}")
rows = rows_of("batch_invariant")  # the trainer against itself, and against the rollout, under batch-invariant kernels
self_gap = [r.get("trainer_corr/logprob_abs_diff_max", float("nan")) for r in rows]
verdict("batch-invariant kernels", len(rows) > 0 and all(g == 0.0 for g in self_gap),
        f"{len(rows)} steps, trainer vs itself max |dlogprob| {self_gap} (0 expected), rollout vs trainer max "
        f"{[round(r.get('rollout_corr/logprob_abs_diff_max', float('nan')), 6) for r in rows]}")
for run in ("bf16", "fp16", "sleep", "int8_reward", "long_rows"):  # the sync probe: every sync's logprob gap
    probe = [r["rollout/sync_probe_gap"] for r in rows_of(run) if "rollout/sync_probe_gap" in r]
    verdict(f"sync probe ({run})", len(probe) > 0, f"gaps {[f'{g:.2e}' for g in probe]} (past algos.probe_bound the run stops)")
for run in ("bf16", "sleep"):  # the actor's device memory per stage, awake vs asleep during generation
    try:
        last = [r for r in map(json.loads, open(f"{out}/{run}/metrics.jsonl")) if "reward/mean" in r][-1]
    except (FileNotFoundError, IndexError):
        print(f"{run}: no metrics (run failed)"); continue
    print(f"actor device MiB per stage ({run}):",
          {s: round(last.get(f"memory/{s}/actor/total_mib", float("nan"))) for s in ("rollout", "score", "update", "sync")})
PY
