#!/usr/bin/env bash
# One device visit on the H200 (after `source .device-wheels/b/install.sh`, ../shared/cuda-host/README.md);
# logs go to $OUT. Usage: bash benchmarks/cuda_visit.sh MODE [ARGS]
#   tests        pytest -m cuda tests/test_cuda_kernels.py tests/test_cuda_layer.py tests/test_cuda_launches.py
#                tests/test_cuda_qmm.py tests/test_cuda_head.py tests/test_ops.py tests/test_cuda_prefill.py
#                tests/test_cuda_quantized_kv.py
#   models       pytest -m cuda tests/test_cuda_models.py tests/test_cuda_batch.py
#   correctness  both suites side by side (each over 4 pytest-xdist workers where xdist is installed)
#   bench        the README's table: mlx-fastops bench, 4 models, -p 512,2048,8192 -g 128 -n 3 -> results/cuda_bench.*
#   kv8, kv4     the bench over mlx-lm's 8-bit (4-bit) QuantizedKVCache beside the float cache, 4 models, -p 8192
#                -g 64 -n 3 -> results/cuda_bench_kv8.* (kv4.*)
#   ab NAMES...  the bench and the phase tables, each beside a copy patched without each NAMES
#   tune         mlx-fastops tune on Qwen3-0.6B and Qwen3-4B (the decisions, the first tuning's wall
#                time) -> results/cuda_tune_MODEL.*
#   tune_bench   bench --tune on both, -p 512,2048 -g 128 -n 9 (stock, all fusions, tuned; the decisions
#                cached by `tune` in this visit, else measured again) -> results/cuda_tune.*
#   tune_batch   batched decoding of Qwen3-0.6B and 4B, B = 1, 16, 32: stock, all fusions and a tuned copy (the tuner's
#                verdicts must not cost batched decode its speed) -> results/cuda_batch_tuned.*
#   kernels      isolated kernels against stock, GB/s -> results/cuda_kernels.*
#   batch        batched decoding through mlx-lm's BatchGenerator, 4B, 8B and 0.6B, B = 1-32 -> results/cuda_batch.*
#   qmm          the tensor-core qmm: its GPU tests, then its GEMMs at 9-128 rows -> results/cuda_prefill.*
#   batch_ab     B = 8, 16, 32 on Qwen3-0.6B and 4B with and without `prefill` (qmm's switch) -> $OUT/batch_ab.tgz
#   serve        mlx_lm.server vs mlx-fastops serve over HTTP, Qwen3-0.6B, 1 / 4 / 16 clients (tuner off: it would
#                add its first tuning to the patched server's start) -> results/serve_load.*
#   prefill      GEMMs of 9-8192 rows: stock quantized_matmul, qmm, dequantise + matmul, dense, TFLOP/s -> results/cuda_prefill.*
#   phases       time per phase inside the layer launch -> results/cuda_layer_phases_{large,small}.*, and
#                at 4 and 8 rows (batched decode) -> results/cuda_layer_phases_batch.*
#   phases_l2    the large tables (Qwen3-8B/4B, 1 and 4 rows) with the L2 flushed before each launch and not,
#                in turn, twice -> $OUT/phases_l2.tgz (whether one-layer tables read weights from the L2)
#   trees DIRS.. the large tables at 1, 4 and 8 rows (BATCH=1,4: those) from this tree and from each DIRS (another commit's files, e.g.
#                `git archive BRANCH | tar -x -C DIR`: an untracked folder travels, a worktree does not), in turn,
#                RUNS times (2) -> $OUT/trees.tgz (an A/B of kernel changes by phase)
#   attn_splits  the large one-row tables with 528 / 264 / 132 / 66 attention blocks (splits of the sequence)
#                after 512 and 2048 tokens, with set tails -> $OUT/attn_splits.tgz (is the ~9 us attention phase at
#                short context its splits' merge, and would fewer splits do)
#   host         launch cost by source length, host split per variant -> results/cuda_host.*; then an
#                Nsight Systems NVTX/CUDA-API summary of Qwen3-4B decode where nsys is installed
#   groups       every layer in one launch beside the default, with a cProfile of the step builds
#                -> results/cuda_host_groups.*
#   trace        kernel timeline of decode, stock vs patched (MODEL=qwen3-4b to choose; BATCH=32: that many rows
#                through BatchGenerator; PROMPT: prompt tokens, 512) -> results/cuda_trace_MODEL[_bBATCH].*
#   ncu          Nsight Compute sections of the Qwen3-0.6B kernels
#   ncu_layer    the same for a layer launch (MODEL=qwen3-8b to choose; PROMPT: cached positions, 512; KV_BITS=8
#                or 4: over a quantised cache), with memory workload, warp state and source-counter summaries
#                of the whole launch (not per phase; the stalling SASS lines need ncu's source page) -> $OUT/ncu_layer.log
#   all          correctness, then phases and bench; every log in $OUT/all.tgz
# Result files are written under benchmarks/results/ and copied to $OUT (the device returns what is
# under $OUT). Each mode fits one 600 s device call; hand the machine back after a visit.
set -o pipefail
mode=${1:-bench}
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
R=benchmarks/results
LOGS=$OUT   # where bench() and phases() log
MODELS=qwen3-0.6b,qwen3-4b,llama-3.2-1b,qwen3-8b
# The GPU suites build kernels case by case (NVRTC, ~7 s a case: compile-bound). Where a pytest with
# pytest-xdist was carried (.device-wheels/pytest: benchmarks/README.md), it is installed aside and
# the suites run over 4 workers (the host has 16 cores); only pytest sees it.
if [ -d .device-wheels/pytest ] && [ ! -d /root/test-site/xdist ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /root/test-site .device-wheels/pytest/*.whl
fi
TESTPATH=$( [ -d /root/test-site/xdist ] && echo /root/test-site: )$PYTHONPATH
XDIST=$(PYTHONPATH=$TESTPATH python3 -c "import xdist" 2>/dev/null && echo "-n 4")
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/device.txt"
# The device returns at most 8 files from $OUT: a mode's folder of logs goes back as one archive.
pack() { tar czf "$OUT/$1.tgz" -C "$OUT/$1" . && rm -rf "${OUT:?}/$1"; }
bench() {   # bench OUTPREFIX TIMEOUT [--variant NAMES ...]
  local prefix=$1 limit=$2; shift 2
  timeout "$limit" python3 -m mlx_fastops bench --model $MODELS -p 512,2048,8192 -g 128 -n 3 "$@" \
    --json "$prefix.json" --markdown "$prefix.md" > "$LOGS/bench.log" 2>&1
  grep -E "^\| (qwen|llama)" "$prefix.md" | cut -c1-170
}
phases() {  # phases DIR TIMEOUT [--disable NAMES ...]
  local dir=$1 limit=$2; shift 2
  timeout "$limit" python3 benchmarks/cuda_layer_phases.py --models qwen3-8b,qwen3-4b --layers 1 --reps 12 \
    --disable '' "$@" --out "$dir/cuda_layer_phases_large" > "$LOGS/phases_large.log" 2>&1
  timeout "$limit" python3 benchmarks/cuda_layer_phases.py --models qwen3-0.6b --layers 4,1 --reps 12 \
    --disable '' "$@" --out "$dir/cuda_layer_phases_small" > "$LOGS/phases_small.log" 2>&1
  timeout "$limit" python3 benchmarks/cuda_layer_phases.py --models qwen3-4b,qwen3-8b --layers 1 --reps 12 --batch 4,8 \
    --disable '' "$@" --out "$dir/cuda_layer_phases_batch" > "$LOGS/phases_batch.log" 2>&1
  tail -n 9 "$dir/cuda_layer_phases_large.md" "$dir/cuda_layer_phases_small.md" "$dir/cuda_layer_phases_batch.md"
}
case "$mode" in
  tests)
    timeout "${TEST_TIMEOUT:-560}" env PYTHONPATH="$TESTPATH" python3 -m pytest -m cuda -q -rf $XDIST tests/test_cuda_kernels.py tests/test_cuda_layer.py tests/test_cuda_launches.py tests/test_cuda_qmm.py tests/test_cuda_head.py tests/test_ops.py tests/test_cuda_prefill.py tests/test_cuda_quantized_kv.py -p no:cacheprovider \
      > "$OUT/test_kernels.log" 2>&1
    tail -n 8 "$OUT/test_kernels.log" ;;
  models)
    timeout "${TEST_TIMEOUT:-420}" env PYTHONPATH="$TESTPATH" python3 -m pytest -m cuda -q -rfP $XDIST tests/test_cuda_models.py tests/test_cuda_batch.py -p no:cacheprovider \
      > "$OUT/test_models.log" 2>&1
    grep -E "row|passed|failed|FAILED" "$OUT/test_models.log" | tail -n 60 ;;
  correctness)
    bash "$0" tests > "$OUT/visit_tests.txt" 2>&1 & tests=$!
    bash "$0" models > "$OUT/visit_models.txt" 2>&1
    wait $tests
    tail -n 3 "$OUT/visit_models.txt"; tail -n 4 "$OUT/visit_tests.txt" ;;
  bench)
    bench "$R/cuda_bench" 560; cp "$R"/cuda_bench.* "$OUT/" ;;
  kv8|kv4)
    b=${mode#kv}
    timeout 300 python3 -m mlx_fastops bench --model $MODELS -p 8192 -g 64 -n 3 --kv-bits $b \
      --json "$R/cuda_bench_kv$b.json" --markdown "$R/cuda_bench_kv$b.md" > "$LOGS/bench_kv$b.log" 2>&1
    grep -E "^\| (qwen|llama)" "$R/cuda_bench_kv$b.md" | cut -c1-230; cp "$R"/cuda_bench_kv$b.* "$OUT/" ;;
  tune)
    for m in qwen3-0.6b qwen3-4b; do
      timeout 280 python3 -m mlx_fastops tune --model $m --json "$R/cuda_tune_$m.json" > "$R/cuda_tune_$m.md" \
        2> "$LOGS/tune_$m.log"
      grep -E "^\| |^first tuning" "$R/cuda_tune_$m.md" | tail -n 13
    done
    cp "$R"/cuda_tune_* "$OUT/" ;;
  tune_bench)
    timeout 560 python3 -m mlx_fastops bench --model qwen3-0.6b,qwen3-4b -p 512,2048 -g 128 -n 9 --tune \
      --json "$R/cuda_tune.json" --markdown "$R/cuda_tune.md" > "$LOGS/bench_tune.log" 2>&1
    grep -E "^\| (qwen|llama)" "$R/cuda_tune.md" | cut -c1-200
    cp "$R"/cuda_tune.* "$OUT/" ;;
  batch)
    timeout 560 python3 benchmarks/cuda_batch.py --models qwen3-4b,qwen3-8b,qwen3-0.6b --batches 1,4,8,16,32 -p 256 -g 32 -n 2 \
      --out "$R/cuda_batch" > "$OUT/batch.log" 2>&1
    grep -E "^\| (qwen|llama)" "$R/cuda_batch.md" | cut -c1-170; cp "$R"/cuda_batch.* "$OUT/" ;;
  tune_batch)
    timeout 560 python3 benchmarks/cuda_batch.py --models qwen3-0.6b,qwen3-4b --batches 1,16,32 -p 256 -g 32 -n 3 --tune \
      --out "$R/cuda_batch_tuned" > "$OUT/batch_tuned.log" 2>&1
    grep -E "^\| (qwen|llama)|^\| compile" "$R/cuda_batch_tuned.md" | cut -c1-200; cp "$R"/cuda_batch_tuned.* "$OUT/" ;;
  qmm)
    timeout 240 env PYTHONPATH="$TESTPATH" python3 -m pytest -m cuda -q -rfs $XDIST tests/test_cuda_qmm.py tests/test_ops.py -k "qmm or qkv or gate_up or linear" \
      -p no:cacheprovider > "$OUT/test_qmm.log" 2>&1
    tail -n 4 "$OUT/test_qmm.log"
    timeout 330 python3 benchmarks/cuda_prefill.py --rows 9,16,32,64,128 --out "$R/cuda_prefill" > "$OUT/prefill.log" 2>&1
    grep -E "^\| " "$R/cuda_prefill.md" | cut -c1-150; cp "$R"/cuda_prefill.* "$OUT/" ;;
  batch_ab)
    A="$OUT/batch_ab"; mkdir -p "$A"
    for dis in "" prefill; do
      MLX_FASTOPS_DISABLE=$dis timeout 280 python3 benchmarks/cuda_batch.py --models qwen3-0.6b,qwen3-4b --batches 8,16,32 \
        -p 256 -g 32 -n 2 --out "$A/cuda_batch${dis:+_no_$dis}" > "$A/batch${dis:+_no_$dis}.log" 2>&1
      echo "== disable '$dis'"; grep -E "^\| (qwen|llama)" "$A/cuda_batch${dis:+_no_$dis}.md" | grep " tg" | cut -c1-130
    done
    pack batch_ab ;;
  serve)
    MLX_FASTOPS_TUNE=off timeout 560 python3 benchmarks/serve_load.py --model qwen3-0.6b --clients 1,4,16 \
      --requests-per-client 2 --max-tokens 32 --time-limit 15 --out "$R/serve_load" > "$OUT/serve.log" 2>&1
    grep -E "^\| " "$R/serve_load.md" | cut -c1-170; cp "$R"/serve_load.* "$OUT/" ;;
  ab)
    : "${2:?usage: cuda_visit.sh ab NAMES [NAMES...]}"
    A="$OUT/ab"; mkdir -p "$A"; LOGS=$A; n=$(($# - 1)); bvar=(); pdis=()
    for names in "${@:2}"; do bvar+=(--variant "$names"); pdis+=(--disable "$names"); done
    phases "$A" $((60 * (n + 1))) "${pdis[@]}"
    bench "$A/cuda_bench" $((170 * (n + 1))) "${bvar[@]}"
    pack ab ;;
  trees)
    : "${2:?usage: cuda_visit.sh trees DIR [DIR...]}"
    A="$OUT/trees"; mkdir -p "$A"
    for r in $(seq "${RUNS:-2}"); do for d in . "${@:2}"; do
      n=$( [ "$d" = . ] && echo this || basename "$d")_$r
      (cd "$d" && PYTHONPATH=$PWD:/root/mlx-site timeout 200 python3 benchmarks/cuda_layer_phases.py --models qwen3-4b,qwen3-8b \
        --layers 1 --reps 12 --batch "${BATCH:-1,4,8}" --stamps --out "$A/$n") > "$A/$n.log" 2>&1
      echo "== $n"   # per table: model, rows, then each phase's us and the layer's; its median block's marks;
      # per phase, SMs that ran k of its blocks / their median end, for each k (the per-SM table)
      awk 'function out() { if (t != "") print t; t = "" } function med(c) { split(c, v, " / "); return v[1] }
        /^## Summary/{out(); exit} /^## /{out(); ins = 0; n = split($0, h, /[ ,]+/); t = h[2] " rows " h[8] ": layer " h[n - 1] ","}
        /^Inside/{out(); ins = 1; t = "  ready, waited / first step / written / end:"}
        /^Blocks of a phase per SM/{out(); ins = 2; t = "  per SM, k: SMs / end:"}
        ins == 2 && /^[|] layer/{nk = NF - 4; for (i = 1; i <= nk; i++) { k[i] = $(i + 3); sub(/^k = /, "", k[i]) }}
        /^[|] 0 [|]/ && ins == 2{c = ""; for (i = 1; i <= nk; i++) if ($(i + 3) != "-") c = c (c == "" ? "" : ", ") k[i] ": " $(i + 3)
          t = t " " $3 " " c ";"; next}
        /^[|] 0 [|]/{t = t " " $3 (ins ? " " $4 ", " med($5) " / " med($6) " / " med($7) " / " med($8) ";" : " " $10)}' FS=' *[|] *' "$A/$n.md"
    done; done
    pack trees ;;
  prefill)
    timeout 540 python3 benchmarks/cuda_prefill.py --out "$R/cuda_prefill" > "$OUT/prefill.log" 2>&1
    tail -n 20 "$OUT/prefill.log"; cp "$R"/cuda_prefill.* "$OUT/" ;;
  kernels)
    timeout 150 python3 benchmarks/cuda_kernels.py --out "$R/cuda_kernels" > "$OUT/kernels.log" 2>&1
    tail -n 25 "$OUT/kernels.log"; cp "$R"/cuda_kernels.* "$OUT/" ;;
  phases)
    phases "$R" 150; cp "$R"/cuda_layer_phases_*.md "$R"/cuda_layer_phases_*.json "$OUT/" ;;
  phases_l2)
    A="$OUT/phases_l2"; mkdir -p "$A"
    for r in 1 2; do for mb in 128 0; do
      timeout 120 python3 benchmarks/cuda_layer_phases.py --models qwen3-8b,qwen3-4b --layers 1 --reps 12 --batch 1,4 \
        --flush-l2 $mb --out "$A/flush${mb}_$r" > "$A/flush${mb}_$r.log" 2>&1
      echo "== flush $mb MB, run $r"; grep -E "^\| (qwen|llama)" "$A/flush${mb}_$r.md" | cut -c1-110
    done; done
    pack phases_l2 ;;
  attn_splits)
    A="$OUT/attn_splits"; mkdir -p "$A"
    for p in 512 2048; do for m in qwen3-4b qwen3-8b; do   # one run per model: each writes its tables at its end
      timeout 125 python3 benchmarks/cuda_layer_phases.py --models $m --layers 1 --reps 12 --prompt $p \
        --attn-blocks 528,264,132,66 --out "$A/${m}_prompt$p" > "$A/${m}_prompt$p.log" 2>&1
      echo "== $m, $p cached positions"; grep -E "^\| 0 \| attention|^## " "$A/${m}_prompt$p.md" | cut -c1-160
    done; done
    pack attn_splits ;;
  host)
    timeout 300 python3 benchmarks/cuda_host.py --out "$R/cuda_host" > "$OUT/host.log" 2>&1
    tail -n 24 "$OUT/host.log"; cp "$R"/cuda_host.* "$OUT/"
    if command -v nsys > /dev/null; then
      timeout 150 nsys profile -t cuda,nvtx --sample=none --cpuctxsw=none -o "$OUT/host_4b" python3 -m mlx_fastops \
        bench --model qwen3-4b -p 512 -g 128 -n 2 -q > "$OUT/host_nsys.log" 2>&1
      nsys stats -q -r nvtx_sum,cuda_api_sum "$OUT/host_4b.nsys-rep" > "$OUT/host_nsys_stats.txt" 2>&1
      rm -f "$OUT"/host_4b.*; head -n 45 "$OUT/host_nsys_stats.txt" | cut -c1-160
    else echo "no nsys"; fi ;;
  groups)
    timeout 540 python3 benchmarks/cuda_host.py --skip-launch --group-all --profile --models qwen3-0.6b,qwen3-4b,qwen3-8b \
      --reps 4 --out "$R/cuda_host_groups" > "$OUT/groups.log" 2>&1
    tail -n 16 "$OUT/groups.log"; cp "$R"/cuda_host_groups.* "$OUT/" ;;
  trace)
    timeout 150 python3 benchmarks/cuda_trace.py --model "${MODEL:-qwen3-0.6b}" --batch "${BATCH:-0}" --prompt "${PROMPT:-512}" \
      --out "$R" > "$OUT/trace.log" 2>&1
    grep -v Warning "$OUT/trace.log" | tail -n 40; cp "$R/cuda_trace_${MODEL:-qwen3-0.6b}"*.* "$OUT/" ;;
  ncu)
    timeout 150 ncu --clock-control none -k regex:fastops --launch-count 40 --section SpeedOfLight \
      --section WarpStateStats --section Occupancy --section LaunchStats \
      python3 benchmarks/cuda_kernels.py --only 0.6B --calls 1 --reps 1 --wall-only --out "$OUT/ncu_kernels" > "$OUT/ncu.log" 2>&1
    grep -E "fastops|Duration|Warp Cycles Per Issued|Achieved Occupancy|Registers Per|Grid Size" "$OUT/ncu.log" | head -n 120 ;;
  ncu_layer)
    timeout 240 ncu --clock-control none -k regex:fastops_layer --launch-count 4 --section SpeedOfLight \
      --section WarpStateStats --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
      --section SourceCounters \
      python3 benchmarks/cuda_layer_phases.py --models "${MODEL:-qwen3-8b}" --layers 1 --reps 2 \
      --prompt "${PROMPT:-512}" --kv-bits "${KV_BITS:-0}" --out "$OUT/ncu_phases" \
      > "$OUT/ncu_layer.log" 2>&1
    grep -E "fastops|Duration|Throughput|Warp Cycles Per Issued|Issue Slots Busy|No Eligible|Achieved Occupancy|Registers Per|Stall" \
      "$OUT/ncu_layer.log" | head -n 80 ;;
  all)
    A="$OUT/all"; mkdir -p "$A"; LOGS=$A
    OUT="$A" TEST_TIMEOUT=280 bash "$0" correctness   # the two suites side by side, capped to leave room
    phases "$A" 90
    bench "$A/cuda_bench" 200
    pack all ;;
  *) echo "unknown mode $mode" >&2; exit 2 ;;
esac
