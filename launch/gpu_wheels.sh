#!/usr/bin/env bash
# Wheels for launch/gpu_check.sh on a GPU machine that reaches no registry (Python 3.12, torch and
# transformers installed; DeepSpeed is not): DeepSpeed (pure Python, built here) and the dependencies
# such a machine lacks, into .whl/ (git-ignored). Run here, where pip reaches a registry.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-.venv/bin/python}"
mkdir -p .whl
# the versions this venv runs (pydantic and pydantic-core must match each other)
pins=($("$PY" -c 'from importlib.metadata import version as v
print(*[f"{n}=={v(n)}" for n in ("deepspeed", "hjson", "pydantic", "pydantic-core", "annotated-types", "typing-inspection")])'))
"$PY" -m pip wheel -q --no-deps -w .whl "${pins[0]}"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  "${pins[@]:1}"
ls .whl
