#!/usr/bin/env bash
# Installs into .venv (first time only) and runs the whole test suite, e2e included (or the tests named:
# bash launch/test.sh tests/trainer/test_setup.py).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source launch/env.sh
# no paths given: setup.cfg's testpaths (tests/), everything; paths given: only those
python -m pytest -q -p no:cacheprovider "$@"
