#!/usr/bin/env bash
# One device visit: CUDA tests, then benchmarks; logs to $OUT. Usage (after install.sh):
#   bash benchmarks/cuda_visit.sh [check|ncu|trace|verify|tests|quick|bench|kernels|full]
set -o pipefail
mode=${1:-quick}
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/device.txt"
python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device(), 'cuda', mx.cuda.is_available())"
if [ "$mode" = "verify" ]; then
  K='test_head_kernel or test_gemv_fp32 or test_attention_multi or (test_decode_attention and (bfloat16-128-2 or bfloat16-64-4 or bfloat16-128-4 or bfloat16-256-8 or float16-64-8 or bfloat16-128-1)) or (test_gemv_epilogues and (bfloat16-4-64-1 or bfloat16-8-64-8))'
  timeout 150 python3 -m pytest -m cuda -q -rf tests/test_cuda_kernels.py -k "$K" -p no:cacheprovider 2>&1 | tail -30 > "$OUT/test_kernels.log"
  M='1-qwen3-tiny-4 or 2-qwen3-tiny-4 or 1-llama-tiny-4 or 2-qwen2-tiny-4 or 1-qwen3-tiny-8'
  timeout 170 python3 -m pytest -m cuda -q -s -rf tests/test_cuda_models.py -k "test_greedy and ($M)" -p no:cacheprovider 2>&1 | grep -v '^$' | tail -40 > "$OUT/test_models.log"
  cat "$OUT/test_kernels.log" "$OUT/test_models.log" | grep -v INFO
  exit 0
fi
if [ "$mode" = "check" ]; then
  timeout 240 python3 -m pytest -m cuda -q -rf tests/test_cuda_kernels.py -p no:cacheprovider > "$OUT/test_kernels.log" 2>&1
  tail -15 "$OUT/test_kernels.log"
  timeout 200 python3 -m pytest -m cuda -q -rf tests/test_cuda_models.py -k "real_sizes" -p no:cacheprovider > "$OUT/test_real.log" 2>&1
  tail -15 "$OUT/test_real.log"
  timeout 120 python3 benchmarks/cuda_trace.py --out "$OUT" > "$OUT/trace.log" 2>&1
  grep -v Warning "$OUT/trace.log" | tail -40
  exit 0
fi
if [ "$mode" = "ncu" ]; then
  # where the time of the 0.6B kernels goes: one call each, Nsight Compute sections
  timeout 150 ncu --clock-control none -k regex:fastops --launch-count 8 --section SpeedOfLight \
    --section WarpStateStats --section Occupancy --section LaunchStats \
    python3 benchmarks/cuda_kernels.py --only 0.6B --calls 1 --reps 1 --out "$OUT/ncu_kernels" > "$OUT/ncu.log" 2>&1
  grep -E "fastops|Duration|Warp Cycles Per Issued|Achieved Occupancy|Registers Per|Stall|Memory Throughput|Block Size|Grid Size" "$OUT/ncu.log" | head -120
fi
if [ "$mode" = "trace" ]; then
  timeout 150 python3 benchmarks/cuda_trace.py --out "$OUT" > "$OUT/trace.log" 2>&1
  timeout 200 python3 -m pytest -m cuda -q -s -rf tests/test_cuda_models.py -k "real_size or fp32" -p no:cacheprovider > "$OUT/oracle.log" 2>&1
  tail -5 "$OUT/oracle.log"; cat "$OUT/trace.log" | grep -v Warning | tail -45
  exit 0
fi
if [ "$mode" = "quick" ] || [ "$mode" = "full" ] || [ "$mode" = "tests" ]; then
  timeout 110 python3 -m pytest -m cuda -q tests/test_cuda_kernels.py -p no:cacheprovider 2>&1 | tail -40 > "$OUT/test_kernels.log"
  timeout 110 python3 -m pytest -m cuda -q -s -k "not real_size" tests/test_cuda_models.py -p no:cacheprovider 2>&1 | grep -v '^$' | tail -80 > "$OUT/test_models.log"
  tail -3 "$OUT/test_kernels.log" "$OUT/test_models.log"
fi
if [ "$mode" = "quick" ]; then
  (cd benchmarks && timeout 90 python3 cuda_probe.py 2>&1 | tail -14 | tee "$OUT/probe.log")
  timeout 60 python3 benchmarks/cuda_kernels.py --out "$OUT/cuda_kernels" 2>&1 | tail -22
  timeout 80 python3 benchmarks/cuda_bench.py --models qwen3-0.6b --reps 2 --prompts 512 --out "$OUT/bench_quick" 2>&1 | tail -12
elif [ "$mode" = "bench" ]; then
  # final benchmark: ~5-6 min; results are rewritten after each model, so a timeout keeps the finished ones
  timeout 330 python3 benchmarks/cuda_bench.py --reps 2 --models qwen3-0.6b,qwen3-4b,llama-3.2-1b,qwen3-8b \
    --out benchmarks/results/cuda_bench 2>&1 | tail -40
  cp benchmarks/results/cuda_bench.* "$OUT/" 2>/dev/null
elif [ "$mode" = "kernels" ]; then
  timeout 90 python3 benchmarks/cuda_kernels.py --out benchmarks/results/cuda_kernels 2>&1 | tail -25
  cp benchmarks/results/cuda_kernels.* "$OUT/" 2>/dev/null
elif [ "$mode" = "full" ]; then
  timeout 150 python3 benchmarks/cuda_kernels.py --out benchmarks/results/cuda_kernels 2>&1 | tail -25
  timeout 600 python3 benchmarks/cuda_bench.py --reps 3 --out benchmarks/results/cuda_bench 2>&1 | tail -40
  cp benchmarks/results/cuda_* "$OUT/" 2>/dev/null
fi
