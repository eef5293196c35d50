#!/usr/bin/env bash
# One device visit: CUDA tests, then benchmarks; logs to $OUT. Usage (after install.sh):
#   bash benchmarks/cuda_visit.sh [tests|quick|full]
set -o pipefail
mode=${1:-quick}
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/device.txt"
python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device(), 'cuda', mx.cuda.is_available())"
if [ "$mode" != "bench" ]; then
  timeout 280 python3 -m pytest -m cuda -x -q tests/test_cuda_kernels.py -p no:cacheprovider 2>&1 | tail -40 | tee "$OUT/test_kernels.log"
  timeout 200 python3 -m pytest -m cuda -q -s tests/test_cuda_models.py -p no:cacheprovider 2>&1 | grep -v '^$' | tail -60 | tee "$OUT/test_models.log"
fi
if [ "$mode" = "quick" ]; then
  timeout 150 python3 benchmarks/cuda_bench.py --models qwen3-0.6b --reps 2 --prompts 512 --out "$OUT/bench_quick" 2>&1 | tail -30
elif [ "$mode" = "full" ] || [ "$mode" = "bench" ]; then
  timeout 150 python3 benchmarks/cuda_kernels.py --out benchmarks/results/cuda_kernels 2>&1 | tail -25
  timeout 400 python3 benchmarks/cuda_bench.py --reps 3 --out benchmarks/results/cuda_bench 2>&1 | tail -40
  cp benchmarks/results/cuda_* "$OUT/" 2>/dev/null
fi
