# Sourced by the launch scripts: installs into .venv (idempotent, see install.sh), sets caches.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  VERL_DS_DEVICE=gpu
else
  VERL_DS_DEVICE=cpu
fi

# Install (or skip: launch/install.sh keeps a stamp of what it installed).
bash "$ROOT/launch/install.sh" "$VENV" "$VERL_DS_DEVICE" || { echo "[verl-ds] install failed" >&2; return 1 2>/dev/null || exit 1; }

export PATH="$VENV/bin:$PATH"
# vLLM's sockets and compile cache live under the project (ignored by git). DeepSpeed's JIT op
# cache stays at its per-user default (~/.cache/torch_extensions) so fresh clones and CI reuse it.
export VLLM_CACHE_ROOT="$ROOT/.cache/vllm"
export TMPDIR="$ROOT/.cache/tmp"
mkdir -p "$VLLM_CACHE_ROOT" "$TMPDIR"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export WANDB_SILENT=true
export HF_HUB_DISABLE_PROGRESS_BARS=1  # transformers' per-load "Loading weights" bars: not the run's progress
export VLLM_LOGGING_LEVEL="${VLLM_LOGGING_LEVEL:-WARNING}"   # vLLM logs every prefix-cache reset at INFO
if [ "$VERL_DS_DEVICE" = cpu ]; then
  export DS_ACCELERATOR=cpu
  # launch/train.sh preloads tcmalloc into the training processes (install.sh installs it where it can)
  source "$ROOT/launch/tcmalloc.sh"
  VERL_DS_TCMALLOC="$(tcmalloc_path)"
fi
# What this file sets, for launch/train.sh to hand to the other nodes of a HOSTFILE run.
VERL_DS_EXPORTS=(PATH VLLM_CACHE_ROOT TMPDIR HF_HUB_OFFLINE TRANSFORMERS_OFFLINE HF_DATASETS_OFFLINE WANDB_SILENT
  HF_HUB_DISABLE_PROGRESS_BARS VLLM_LOGGING_LEVEL DS_ACCELERATOR LD_PRELOAD TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD)
