#!/usr/bin/env bash
# One short script for a lent GPU machine: GPU tests, then the GPU benchmarks, results under $OUT.
# Usage (device tool): bash benchmarks/gpu_check.sh   (expects a venv-less machine with python3 + pip)
set -euo pipefail
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
python3 -m pip install -q -e ".[dev]" 2>&1 | tail -2
python3 -m pytest -q -m gpu tests/test_kernels_triton.py 2>&1 | tee "$OUT/gpu_tests.txt" | tail -5
python3 -m pytest -q tests/test_kernels_triton.py 2>&1 | tail -3 | tee -a "$OUT/gpu_tests.txt"
python3 benchmarks/bench_attention_stats.py --csv "$OUT/bench_attention_stats.csv" 2>&1 | tee "$OUT/bench_attention_stats.txt" | tail -20
