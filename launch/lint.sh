#!/usr/bin/env bash
# ruff lint + format check (config: pyproject.toml). `bash launch/lint.sh --fix` applies both.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source launch/env.sh
if [ "${1:-}" = --fix ]; then
  ruff check --fix . && ruff format .
else
  ruff check . && ruff format --check .
fi
