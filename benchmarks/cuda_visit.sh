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
  timeout 110 python3 -m pytest -m cuda -q tests/test_cuda_kernels.py -p no:cacheprovider 2>&1 | tail -40 > "$OUT/test_kernels.log"
  timeout 110 python3 -m pytest -m cuda -q -s -k "not real_size" tests/test_cuda_models.py -p no:cacheprovider 2>&1 | grep -v '^$' | tail -80 > "$OUT/test_models.log"
  tail -3 "$OUT/test_kernels.log" "$OUT/test_models.log"
fi
if [ "$mode" = "quick" ]; then
  (cd benchmarks && timeout 90 python3 cuda_probe.py 2>&1 | tail -14 | tee "$OUT/probe.log")
  timeout 60 python3 benchmarks/cuda_kernels.py --out "$OUT/cuda_kernels" 2>&1 | tail -22
  timeout 80 python3 benchmarks/cuda_bench.py --models qwen3-0.6b --reps 2 --prompts 512 --out "$OUT/bench_quick" 2>&1 | tail -12
elif [ "$mode" = "full" ] || [ "$mode" = "bench" ]; then
  timeout 150 python3 benchmarks/cuda_kernels.py --out benchmarks/results/cuda_kernels 2>&1 | tail -25
  timeout 400 python3 benchmarks/cuda_bench.py --reps 3 --out benchmarks/results/cuda_bench 2>&1 | tail -40
  cp benchmarks/results/cuda_* "$OUT/" 2>/dev/null
fi
