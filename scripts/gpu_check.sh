#!/usr/bin/env bash
# One device call: every CUDA test, then the GPU benchmarks named in $SLUICE_BENCH (space-separated
# script names under scripts/, each run with its default options). Logs go to $OUT.
set -uo pipefail
out=${OUT:-/tmp/sluice-gpu}; mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
df -h /dev/shm | tail -1; free -g | head -2; nproc
export PYTHONUNBUFFERED=1
export SLUICE_TEST_LOG="$out/test_times.log"  # each test's seconds as it ends (tests/conftest.py)
python -m pytest -m cuda -q -p no:cacheprovider ${SLUICE_PYTEST_ARGS:-} 2>&1 | tee "$out/cuda_tests.log" | tail -40
for bench in ${SLUICE_BENCH:-}; do
    echo "== $bench"
    python "scripts/$bench" --json "$out/${bench%.py}.json" 2>&1 | tee "$out/${bench%.py}.log" | tail -25
done
