#!/usr/bin/env bash
# Installs into .venv (first time only) and runs the whole test suite, e2e included.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source launch/env.sh
python -m pytest tests -q -p no:cacheprovider "$@"
