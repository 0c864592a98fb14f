#!/usr/bin/env bash
# The prepared check of one GPU (tools/gpu_check.py says what it runs).
#
#   tools/gpu_check.sh --fetch-wheels   here, with a registry: build gpu_wheels/
#   tools/gpu_check.sh --dry-run        anywhere: list every step, run those that
#                                       need no GPU, check the wheels (CI runs it)
#   tools/gpu_check.sh --out "$OUT"     on the GPU machine, with gpu_wheels/ carried
#
# The interpreter is $PYTHON, else the checkout's .venv where there is one (here
# and in CI), else python3 (the GPU machine's, which holds torch).
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-}
if [ -z "$python" ]; then
  if [ -x .venv/bin/python ]; then python=.venv/bin/python; else python=python3; fi
fi

if [ "${1:-}" = "--fetch-wheels" ]; then
  shift
  exec "$python" tools/gpu_wheels.py fetch "$@"
fi
export PYTHONUNBUFFERED=1
exec "$python" tools/gpu_check.py "$@"
