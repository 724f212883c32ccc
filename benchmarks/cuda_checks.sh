#!/usr/bin/env bash
# GPU checks for the paged_experts runtime, run in the repo root on the device machine:
# the CUDA equality tests, then the page-in micro-benchmark. Results go under ${OUT:-out}/.
set -uo pipefail
OUT="${OUT:-out}"
mkdir -p "$OUT"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$(pwd)"
nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv | tee "$OUT/gpu.csv"
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)' | tee "$OUT/versions.txt"
if python3 -c 'import pytest' 2>/dev/null; then
  python3 -m pytest tests/cuda -m cuda -v -p no:cacheprovider -o addopts= 2>&1 | tee "$OUT/cuda_tests.txt"
else  # the test module doubles as a script where pytest is missing
  python3 tests/cuda/test_cuda_runtime.py 2>&1 | tee "$OUT/cuda_tests.txt"
fi
tests_rc=${PIPESTATUS[0]}
python3 benchmarks/pagein.py --out "$OUT/pagein.json" "$@" 2>&1 | tee "$OUT/pagein.txt"
bench_rc=${PIPESTATUS[0]}
echo "cuda tests rc=$tests_rc pagein rc=$bench_rc" | tee "$OUT/summary.txt"
exit $(( tests_rc != 0 || bench_rc != 0 ))
