#!/usr/bin/env bash
# One device visit (after `source .device-wheels/b/install.sh`); logs go to $OUT. Usage:
#   bash benchmarks/cuda_visit.sh tests    # pytest -m cuda tests/test_cuda_kernels.py (7.4 min in one process)
#   bash benchmarks/cuda_visit.sh models   # pytest -m cuda tests/test_cuda_models.py (6 min in one process)
#   bash benchmarks/cuda_visit.sh correctness  # both suites side by side (~3.5 min on the H200 with xdist)
# The test modes spread over 4 pytest-xdist workers where it is installed (the H200 image has it;
# NVRTC compiles, ~3 s per kernel variant, run on the CPU).
#   bash benchmarks/cuda_visit.sh trace    # kernel timeline of Qwen3-0.6B decode, stock vs patched (~1 min)
#   bash benchmarks/cuda_visit.sh ncu      # Nsight Compute sections of the 0.6B kernels (~1 min)
#   bash benchmarks/cuda_visit.sh ncu_layer  # the same for the Qwen3-8B layer launch, with memory
#                                          # workload and stall reasons (written 2026-11-30, not yet run)
#   bash benchmarks/cuda_visit.sh bench    # benchmarks/results/cuda_bench.* for 4 models, 4 repetitions (~2.5 min: 105 s at 3)
#   bash benchmarks/cuda_visit.sh kernels  # benchmarks/results/cuda_kernels.* (~1-2 min)
#   bash benchmarks/cuda_visit.sh layer    # the layer-launch kernel tests (~4 min)
#   bash benchmarks/cuda_visit.sh variants # bench beside the variants without layer_groups / layer_kernel (~6 min)
#   bash benchmarks/cuda_visit.sh phases   # time per phase inside the layer launch, Qwen3-0.6B and 8B (~1.5 min)
#   bash benchmarks/cuda_visit.sh host     # benchmarks/cuda_host.py (launch cost by source length; 1/2/4 layers
#                                          # per launch, Qwen3-4B/8B), then an Nsight Systems NVTX/CUDA-API
#                                          # summary of 4B decode where nsys is installed (~3 min)
#   bash benchmarks/cuda_visit.sh groups   # decode of Qwen3-0.6B and Llama-1B with at most 1, 4, 7 layers per
#                                          # launch beside the default (all), and a cProfile of the default's
#                                          # step builds (cuda_host.py --profile; ~6.5 min)
#   bash benchmarks/cuda_visit.sh ab NAME [NAME...]  # phases (8B, 4B; 0.6B at 4 and 1 layers per launch)
#                                          # and the bench (3 repetitions), each beside the variant without
#                                          # each fusion NAME (~4 min for one NAME); every log in $OUT/ab.tgz
#   bash benchmarks/cuda_visit.sh all      # correctness, then phases (8B, 4B, 0.6B), then bench at 3
#                                          # repetitions (~7.5 min); every log in $OUT/all.tgz
# The device returns at most 8 files from $OUT (alphabetically): pack anything larger into a tarball.
# Its idle warm time counts against the session's budget: hand it back (give_back) after a visit.
set -o pipefail
mode=${1:-trace}
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
XDIST=$(python3 -c "import xdist" 2>/dev/null && echo "-n 4")
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/device.txt"
# Phases (Qwen3-8B, 4B; 0.6B at 4 and 1 layers per launch), then the bench at 3 repetitions, into
# DIR; with NAMES, each beside the variant without each fusion NAME. Args: DIR, NAMES (space-separated,
# or "") and the three steps' timeouts in seconds.
phases_and_bench() {
  local A=$1 dis=(--disable '') bdis=() name
  for name in $2; do dis+=(--disable "$name"); bdis+=(--disable "$name"); done
  timeout "$3" python3 benchmarks/cuda_layer_phases.py --models qwen3-8b,qwen3-4b --layers 1 --reps 12 \
    "${dis[@]}" --out "$A/phases_large" > "$A/phases_large.log" 2>&1
  timeout "$4" python3 benchmarks/cuda_layer_phases.py --models qwen3-0.6b --layers 4,1 --reps 12 \
    "${dis[@]}" --out "$A/phases_small" > "$A/phases_small.log" 2>&1
  tail -n 9 "$A/phases_large.log" "$A/phases_small.log"
  timeout "$5" python3 benchmarks/cuda_bench.py --reps 3 --models qwen3-0.6b,qwen3-4b,llama-3.2-1b,qwen3-8b \
    "${bdis[@]}" --out "$A/cuda_bench" > "$A/bench.log" 2>&1
  grep -E "tg128|pp" "$A/cuda_bench.md" | cut -c1-150
}
case "$mode" in
  tests)
    timeout ${TEST_TIMEOUT:-560} python3 -m pytest -m cuda -q -rf $XDIST tests/test_cuda_kernels.py -p no:cacheprovider > "$OUT/test_kernels.log" 2>&1
    tail -n 8 "$OUT/test_kernels.log" ;;
  models)
    timeout ${TEST_TIMEOUT:-420} python3 -m pytest -m cuda -q -rfP $XDIST tests/test_cuda_models.py -p no:cacheprovider > "$OUT/test_models.log" 2>&1
    grep -E "row|passed|failed|FAILED" "$OUT/test_models.log" | tail -n 60 ;;
  correctness)
    bash "$0" tests > "$OUT/visit_tests.txt" 2>&1 & tests=$!
    bash "$0" models > "$OUT/visit_models.txt" 2>&1
    wait $tests
    tail -n 3 "$OUT/visit_models.txt"; tail -n 4 "$OUT/visit_tests.txt" ;;
  trace)
    timeout 150 python3 benchmarks/cuda_trace.py --out "$OUT" > "$OUT/trace.log" 2>&1
    grep -v Warning "$OUT/trace.log" | tail -40 ;;
  ncu)
    timeout 150 ncu --clock-control none -k regex:fastops --launch-count 40 --section SpeedOfLight \
      --section WarpStateStats --section Occupancy --section LaunchStats \
      python3 benchmarks/cuda_kernels.py --only 0.6B --calls 1 --reps 1 --wall-only --out "$OUT/ncu_kernels" > "$OUT/ncu.log" 2>&1
    grep -E "fastops|Duration|Warp Cycles Per Issued|Achieved Occupancy|Registers Per|Grid Size" "$OUT/ncu.log" | head -120 ;;
  ncu_layer)
    timeout 240 ncu --clock-control none -k regex:fastops_layer --launch-count 4 --section SpeedOfLight \
      --section WarpStateStats --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
      python3 benchmarks/cuda_layer_phases.py --models qwen3-8b --layers 1 --reps 2 --out "$OUT/ncu_phases" \
      > "$OUT/ncu_layer.log" 2>&1
    grep -E "fastops|Duration|Throughput|Warp Cycles Per Issued|Issue Slots Busy|No Eligible|Achieved Occupancy|Registers Per|Stall" \
      "$OUT/ncu_layer.log" | head -80 ;;
  bench)
    timeout 560 python3 benchmarks/cuda_bench.py --reps 4 --models qwen3-0.6b,qwen3-4b,llama-3.2-1b,qwen3-8b \
      --out benchmarks/results/cuda_bench > "$OUT/bench.log" 2>&1
    tail -32 "$OUT/bench.log"; cp benchmarks/results/cuda_bench.* "$OUT/" ;;
  kernels)
    timeout 150 python3 benchmarks/cuda_kernels.py --out benchmarks/results/cuda_kernels > "$OUT/kernels.log" 2>&1
    tail -25 "$OUT/kernels.log"; cp benchmarks/results/cuda_kernels.* "$OUT/" ;;
  layer)
    timeout 300 python3 -m pytest -m cuda -q -rf $XDIST tests/test_cuda_kernels.py -k \
      "one_launch or tiny_model or causal or layer_groups or layers_in" -p no:cacheprovider > "$OUT/test_layer.log" 2>&1
    tail -n 5 "$OUT/test_layer.log" ;;
  variants)
    timeout 540 python3 benchmarks/cuda_bench.py --reps 3 --models qwen3-0.6b,qwen3-4b,llama-3.2-1b,qwen3-8b \
      --disable layer_groups --disable layer_kernel --out "$OUT/bench_variants" > "$OUT/bench_variants.log" 2>&1
    tail -n 30 "$OUT/bench_variants.log" ;;
  phases)
    timeout 300 python3 benchmarks/cuda_layer_phases.py --layers 4,1 --out "$OUT" > "$OUT/phases.log" 2>&1
    tail -n 60 "$OUT/phases.log" ;;
  host)
    timeout 240 python3 benchmarks/cuda_host.py --out "$OUT/cuda_host" > "$OUT/host.log" 2>&1
    tail -n 24 "$OUT/host.log"
    if command -v nsys > /dev/null; then
      timeout 150 nsys profile -t cuda,nvtx --sample=none --cpuctxsw=none -o "$OUT/host_4b" python3 benchmarks/cuda_host.py \
        --skip-launch --models qwen3-4b --groups "" --reps 2 --out "$OUT/host_nsys_run" > "$OUT/host_nsys.log" 2>&1
      nsys stats -q -r nvtx_sum,cuda_api_sum "$OUT/host_4b.nsys-rep" > "$OUT/host_nsys_stats.txt" 2>&1
      rm -f "$OUT"/host_4b.*; head -n 45 "$OUT/host_nsys_stats.txt" | cut -c1-160
    else echo "no nsys"; fi ;;
  groups)
    timeout 420 python3 benchmarks/cuda_host.py --skip-launch --profile --models qwen3-0.6b,llama-3.2-1b \
      --groups 1,4,7 --out "$OUT/cuda_host_groups" > "$OUT/groups.log" 2>&1
    tail -n 16 "$OUT/groups.log" ;;
  ab)
    A="$OUT/ab"; mkdir -p "$A"
    : "${2:?usage: cuda_visit.sh ab NAME [NAME...]}"
    n=$(($# - 1))   # the caps grow with the variants measured
    phases_and_bench "$A" "${*:2}" $((65 * (n + 1))) $((60 * (n + 1))) $((170 * (n + 1)))
    tar czf "$OUT/ab.tgz" -C "$A" . ;;
  all)
    A="$OUT/all"; mkdir -p "$A"
    # the two suites side by side, capped so that the whole mode fits one 600 s device call
    OUT="$A" TEST_TIMEOUT=280 bash "$0" correctness
    phases_and_bench "$A" "" 100 80 200
    tar czf "$OUT/all.tgz" -C "$A" . ;;
  *) echo "unknown mode $mode" >&2; exit 2 ;;
esac
