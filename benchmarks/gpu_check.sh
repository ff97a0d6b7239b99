#!/usr/bin/env bash
# Measured vs predicted on one GPU, in under 8 minutes: see benchmarks/gpu_check.py's docstring.
# Run from anywhere; nothing is installed or downloaded (this checkout's src/ is put on PYTHONPATH).
#   bash benchmarks/gpu_check.sh                 # results under $OUT, else benchmarks/results/
#   PYTHON=/path/to/python bash benchmarks/gpu_check.sh --steps 20
# Needs: a Python with jax (+ its CUDA plugin), flax, optax, orbax-checkpoint, numpy, PyYAML, rich and
# omegaconf; the driver names any that is missing in one line and exits 2.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$(command -v python3 || command -v python)}"
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
# The driver keeps every phase to its budget (--total-budget-s, default 450 s); this is the backstop.
exec timeout --signal=TERM --kill-after=10 470 "$PY" benchmarks/gpu_check.py "$@"
