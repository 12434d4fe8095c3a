#!/usr/bin/env bash
# benchmarks/setup_trl.sh: a separate venv (benchmarks/.venv-trl) with TRL's GRPOTrainer, so the
# comparison in benchmarks/side_by_side.sh cannot disturb the project's pins in .venv.
# torch and transformers are pinned to the versions .venv has (torch the same local CPU wheel that
# launch/install.sh installs); TRL plain-transformers generation only (no vLLM here).
# Idempotent: skips the install when the stamp matches. Env: PYTHON (default python3).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="$HERE/.venv-trl"
PY="${PYTHON:-python3}"
TORCH=2.13.0
TRANSFORMERS=5.19.0
TRL=1.16.0
REASONING_GYM=0.1.25   # the tool and SmolLM2 jobs read their data through verl-ds (the version .venv has)
STAMP="torch==$TORCH transformers==$TRANSFORMERS trl==$TRL reasoning-gym==$REASONING_GYM $(sha256sum "$HERE/setup_trl.sh" | cut -d' ' -f1)"

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup_trl] creating $VENV" >&2
  "$PY" -m venv "$VENV"
fi
if [ "$(cat "$VENV/.trl-stamp" 2>/dev/null)" != "$STAMP" ]; then
  echo "[setup_trl] installing torch==$TORCH transformers==$TRANSFORMERS trl==$TRL into $VENV" >&2
  pip="$VENV/bin/python -m pip"
  $pip install -q --upgrade pip
  # torch first and alone, as launch/install.sh does (the CPU wheel from pip's configured find-links)
  $pip install -q "torch==$TORCH"
  $pip install -q "torch==$TORCH" "transformers==$TRANSFORMERS" "trl==$TRL" "reasoning-gym==$REASONING_GYM"
  # torchvision & co. are not needed; drop any CUDA media packages a dependency pulled in
  $pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  echo "$STAMP" > "$VENV/.trl-stamp"
fi
"$VENV/bin/python" -c "import torch, transformers, trl; print('[setup_trl] torch', torch.__version__, \
'transformers', transformers.__version__, 'trl', trl.__version__)" >&2
