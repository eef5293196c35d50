"""GEMMs of more than 8 rows on MLX's CUDA backend: TFLOP/s of stock quantized_matmul, of our
tensor-core quantised matmul (backends/cuda/qmm.py, up to QMM_BENCH_MAX_M rows), of the prefill path
(weights dequantised per call + dense matmul, backends/cuda/prefill.py) and of a dense bf16 matmul
on a weight dequantised beforehand (the tensor cores' ceiling for the shape); the weight read of our
matmul in GB/s (the decode-like rows are bandwidth-bound: against the copy bandwidth, ~2.9 TB/s).

    python3 benchmarks/cuda_prefill.py [--rows 9,16,32,64,128,256,511,1024,2048,8192] [--reps 5]
        [--out benchmarks/results/cuda_prefill]

Each time is the median over reps of a graph of CALLS calls on distinct weight copies (so no call
reads the previous one's weights from the 50 MB L2), evaluated and synchronised, divided by CALLS.
FLOP = 2 M N K. Writes OUT.md and OUT.json.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx

from cuda_kernels import timeit
from mlx_fastops.backends.cuda import prefill, qmm
from mlx_fastops.bench import machine
from mlx_fastops.ops.weights import PackedLinear

CALLS = 4
QMM_BENCH_MAX_M = 2048
# (label, K, N): the projections of the benchmark models (qkv and gate/up stacked)
SHAPES = [("0.6B gate/up", 1024, 6144), ("0.6B down", 3072, 1024), ("4B qkv", 2560, 6144), ("4B gate/up", 2560, 19456), ("4B down", 9728, 2560),
          ("8B qkv", 4096, 6144), ("8B gate/up", 4096, 24576), ("8B down", 12288, 4096),
          ("0.6B lm_head", 1024, 151936)]


def timed(fn, reps):
    """Seconds per call: cuda_kernels.timeit's median over reps of the graph, divided by CALLS."""
    return timeit(fn, reps) / CALLS


def case(label, K, N, M, reps):
    ws = []
    for _ in range(CALLS):
        wq, s, b = mx.quantize(mx.random.normal((N, K)) * 0.05, group_size=64, bits=4)
        ws.append(PackedLinear(wq, s.astype(mx.bfloat16), b.astype(mx.bfloat16), None, (N,), K, 4, 64))
    dense = [prefill.dense(w) for w in ws]
    x = mx.random.normal((M, K)).astype(mx.bfloat16)
    mx.eval(ws, dense, x)
    stock = lambda: [mx.quantized_matmul(x, w.weight, w.scales, w.biases, transpose=True, group_size=64, bits=4)
                     for w in ws]
    tensor_cores = lambda: [qmm.qmm(x, w) for w in ws]
    dequantised = lambda: [prefill.linear(x, w) for w in ws]
    ceiling = lambda: [x @ d.T for d in dense]
    flop = 2 * M * N * K
    row = {"shape": label, "K": K, "N": N, "M": M}
    for name, fn in (("stock", stock), ("qmm", tensor_cores), ("dequantised", dequantised), ("dense", ceiling)):
        if name == "qmm" and M > QMM_BENCH_MAX_M:
            continue
        t = timed(fn, reps)
        row[name] = flop / t / 1e12
        if name == "qmm":
            row["qmm_gbs"] = (N * K // 2 + 4 * N * K // 64 + 2 * M * (K + N)) / t / 1e9
    del ws, dense
    mx.clear_cache()
    return row


def markdown(rows, meta):
    lines = ["# GEMMs of more than 8 rows: TFLOP/s (4-bit g64, bf16)", "",
             "| shape (K x N) | M | stock quantized_matmul | tensor-core qmm (GB/s) | dequantise + matmul | "
             "dense bf16 matmul | the faster of qmm and dequantise + matmul / stock |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        q = f"{r['qmm']:.1f} ({r['qmm_gbs']:.0f})" if "qmm" in r else "-"
        best = max(r.get("qmm", 0.0), r["dequantised"])
        lines.append(f"| {r['shape']} {r['K']} x {r['N']} | {r['M']} | {r['stock']:.1f} | {q} | "
                     f"{r['dequantised']:.1f} | {r['dense']:.1f} | {best / r['stock']:.2f}x |")
    m = meta
    lines += ["", f"{m.get('gpu')}; mlx {m['mlx']}, commit {m['commit']} (sources {m['sources']}), {m['date']}. "
              f"Median of the reps of {CALLS} calls on distinct weight copies; FLOP = 2 M N K."]
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="9,16,32,64,128,256,511,1024,2048,8192", help="M values, comma-separated")
    ap.add_argument("--only", default="", help="the shapes whose label contains this")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/cuda_prefill", help="writes OUT.md and OUT.json")
    a = ap.parse_args()
    rows = []
    for label, K, N in SHAPES:
        if a.only not in label:
            continue
        for M in (int(m) for m in a.rows.split(",")):
            if "lm_head" in label and M > 2048:
                continue
            rows.append(case(label, K, N, M, a.reps))
            r = rows[-1]
            print(f"{label:14s} M={M:5d} stock {r['stock']:6.1f} qmm {r.get('qmm', 0):6.1f} "
                  f"dequantised {r['dequantised']:6.1f} dense {r['dense']:6.1f}", flush=True)
    meta = machine()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out + ".json").write_text(json.dumps({"machine": meta, "rows": rows}, indent=1))
    Path(a.out + ".md").write_text(markdown(rows, meta))


if __name__ == "__main__":
    main()
