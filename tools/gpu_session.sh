#!/usr/bin/env bash
# One device call: GPU tests and benchmarks, logs under $OUT, a short table last.
# Usage (on the GPU host, repository root):  bash tools/gpu_session.sh [tests|bench|all] [pytest -k expr]
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
what=${1:-all}; sel=${2:-}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader | tee "$OUT/gpu.txt"
if [[ $what == tests || $what == all ]]; then
  python3 -m pytest -q -m gpu -p no:cacheprovider ${sel:+-k "$sel"} tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
fi
if [[ $what == bench || $what == all ]]; then
  for b in ${BENCHES:-bench_core}; do timeout 300 python3 tools/$b.py --out "$OUT" 2>&1 | tee "$OUT/$b.log" | tail -40; done
fi
