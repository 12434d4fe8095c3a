#!/usr/bin/env bash
# Train under the deepspeed launcher: bash launch/train.sh CONFIG.yaml [key=value ...]
# Env: NUM_RANKS (default: GPUs, or 2 on CPU), MASTER_PORT, VERL_DS_NO_TCMALLOC=1 (CPU: glibc's malloc),
#      HOSTFILE (several nodes, through the `deepspeed` runner: pdsh + ssh to each host; the repo at
#      the same path on every node), MASTER_ADDR (with HOSTFILE; default: the runner asks the first
#      host's `hostname -I`),
#      CUDA_VISIBLE_DEVICES (a scheduler's GPUs, indices or GPU-/MIG- UUIDs, one rank each, as given).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
config="${1:?usage: launch/train.sh CONFIG.yaml [key=value ...]}"; shift
# The launch variables, checked here: one line naming the variable (the launcher would name its flags)
_bad() { echo "error: $1" >&2; exit 2; }
if [ -n "${NUM_RANKS:-}" ]; then
  [[ "$NUM_RANKS" =~ ^[0-9]+$ ]] || _bad "NUM_RANKS: '$NUM_RANKS' is not a number of ranks (a whole number, e.g. NUM_RANKS=2)"
  if [ "$NUM_RANKS" -eq 0 ] && [ "$VERL_DS_DEVICE" = cpu ]; then
    _bad "NUM_RANKS: 0 ranks; on CPU give 1 or more (0 means one per GPU on a GPU node)"
  fi
fi
if [ -n "${MASTER_PORT:-}" ] && { ! [[ "$MASTER_PORT" =~ ^[0-9]+$ ]] || [ "$MASTER_PORT" -lt 1 ] || [ "$MASTER_PORT" -gt 65535 ]; }; then
  _bad "MASTER_PORT: '$MASTER_PORT' is not a TCP port (1-65535)"
fi
if [ -n "${VERL_DS_TCMALLOC:-}" ] && [ -z "${VERL_DS_NO_TCMALLOC:-}" ]; then
  # CPU: tcmalloc in every rank (and its vLLM engine): glibc's malloc hands large tensors' pages back to
  # the kernel and faults them in again at each allocation (the demo's step: ~0.8x the time with it)
  export LD_PRELOAD="$VERL_DS_TCMALLOC${LD_PRELOAD:+:$LD_PRELOAD}"
  export TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD="${TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD:-1099511627776}"
fi
port="${MASTER_PORT:-$(python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')}"
args=(--master_port "$port")
envfile=""
if [ -n "${HOSTFILE:-}" ]; then
  # DeepSpeed's runner treats a missing hostfile as "train on this machine only": refuse it instead.
  if [ ! -f "$HOSTFILE" ] || ! grep -qE '^[[:space:]]*[^#[:space:]]' "$HOSTFILE"; then
    echo "error: HOSTFILE: $HOSTFILE is missing or lists no hosts (one 'host slots=N' line per node)" >&2
    exit 2
  fi
  args+=(--hostfile "$HOSTFILE")
  if [ -n "${MASTER_ADDR:-}" ]; then args+=(--master_addr "$MASTER_ADDR"); fi
  if [ "$VERL_DS_DEVICE" = cpu ]; then export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"; fi
  # The runner starts each node's launcher over ssh in a bare login environment, forwarding only
  # PYTHON* variables and the lines of DeepSpeed's env file: hand every node env.sh's settings and the
  # thread count, then the lines of the user's own env file (~/ and ./.deepspeed_env), which win.
  envfile="$(mktemp)"
  for v in "${VERL_DS_EXPORTS[@]}" OMP_NUM_THREADS; do
    if [ -n "${!v:-}" ]; then echo "$v=${!v}"; fi
  done > "$envfile"
  name="${DS_ENV_FILE:-.deepspeed_env}"
  case "$name" in /*) user_files=("$name") ;; *) user_files=("$HOME/$name" "$name") ;; esac
  for f in "${user_files[@]}"; do if [ -f "$f" ]; then grep '=' "$f" >> "$envfile" || true; fi; done
  export DS_ENV_FILE="$envfile"
elif [ "$VERL_DS_DEVICE" = cpu ]; then
  # CPU: one OpenMP thread per rank, so the ranks and the vLLM worker share the cores.
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
fi
# DeepSpeed's CPU shm all-reduce leaves a ~66 MB /dev/shm file per rank; remove this run's on exit.
trap 'rm -f /dev/shm/deepspeed_allreduce_buffer_*_"$port"_* ${envfile:+"$envfile"} 2>/dev/null || true' EXIT
if [ -z "${HOSTFILE:-}" ]; then
  # One node: DeepSpeed's per-node launcher without the `deepspeed` runner in front (3-4 s less). GPUs:
  # one rank per CUDA_VISIBLE_DEVICES entry as given (indices or UUIDs), else per GPU; the runner's
  # --include/--num_gpus take indices of all the node's GPUs and drop CUDA_VISIBLE_DEVICES.
  ranks=(--num_ranks "${NUM_RANKS:-2}")
  if [ "$VERL_DS_DEVICE" = gpu ]; then ranks=(--gpus --num_ranks "${NUM_RANKS:-0}"); fi
  python -m verl_ds.launcher "${ranks[@]}" --master_port "$port" -- \
    --module verl_ds.cli train --config "$config" "$@"
else
  deepspeed "${args[@]}" --module verl_ds.cli train --config "$config" "$@"
fi
