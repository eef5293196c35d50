"""Per-kernel microbenchmarks on MLX's CUDA backend: achieved GB/s against measured copy bandwidth.

    python3 benchmarks/cuda_kernels.py [--only TEXT] [--calls 64] [--reps 7] [--wall-only]
        [--out benchmarks/results/cuda_kernels]

Each case builds a graph of CALLS independent calls (rotating over enough weight copies that the
working set exceeds the 50 MB L2), evaluates it, and divides. Two times per call: wall (Python
graph building, MLX's encoding of each node and the GPU: for short kernels mostly host cost) and
GPU (the summed durations of the graph's kernels, recorded by CUPTI through torch.profiler,
cuda_trace.kernels_of; without torch that column is left out). GB/s and speed-ups are of the GPU
times where present. Independent calls may run side by side on the GPU, which stretches each one's
duration most for kernels that leave SMs idle (docs/cuda-design.md: qmm's gate/up at 2 warps, 30.5
us alone vs 18.4 in the model's step), and kernels with tickets in a shared buffer must not be
timed this way at all (they race): time those in the model (cuda_trace.py) or chained.
Stock = mx.quantized_matmul (GEMV shapes) / mx.fast.scaled_dot_product_attention on cache slices;
ours = cuda/gemv.cu / cuda/attention.cu (the "lm_head M=" cases: the lm_head op, qmm.cu from 2 rows).
Bytes = weights + scales/biases + x + y (GEMV), the K and V rows read (attention). Writes OUT.md and
OUT.json.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx

from mlx_fastops.backends.cuda import attention, gemv, source
from mlx_fastops.bench import machine
from mlx_fastops.ops.weights import PackedLinear

CALLS = 64
REPS = 7
WALL_ONLY = False


def timeit(fn, reps=None, warmup=2, stat=statistics.median):
    """stat (the median) of reps wall times of evaluating fn(), after warmup evaluations."""
    reps = reps or REPS
    for _ in range(warmup):
        mx.eval(fn())
    mx.synchronize()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        ts.append(time.perf_counter() - t0)
    return stat(ts)


def gpu_time(fn, reps=3):
    """Median over reps of the summed kernel durations (s) of evaluating fn(), or None without torch
    (or with --wall-only)."""
    if WALL_ONLY:
        return None
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
        from cuda_trace import kernels_of
    except ImportError:
        return None
    torch.cuda.synchronize()   # as cuda_trace.py does before profiling
    mx.eval(fn())
    mx.synchronize()
    ts = []
    for _ in range(reps):
        outs = fn()   # built outside the profile: only the evaluation's kernels are recorded
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            mx.eval(outs)
            mx.synchronize()
        ts.append(sum(end - start for _, start, end in kernels_of(prof)) * 1e-6)
    return statistics.median(ts)


def timings(label, stock, ours, nbytes, **shape):
    """One table row: wall and GPU time per call of stock and ours, GB/s of the GPU times (of the
    wall times without torch)."""
    row = {"case": label, **shape, "bytes": nbytes,
           "stock_wall_us": timeit(stock) / CALLS * 1e6, "ours_wall_us": timeit(ours) / CALLS * 1e6}
    gs, go = gpu_time(stock), gpu_time(ours)
    if gs is not None:
        row.update(stock_gpu_us=gs / CALLS * 1e6, ours_gpu_us=go / CALLS * 1e6)
    key = "gpu" if gs is not None else "wall"
    row.update(stock_GBs=nbytes / (row[f"stock_{key}_us"] * 1e-6) / 1e9,
               ours_GBs=nbytes / (row[f"ours_{key}_us"] * 1e-6) / 1e9)
    return row


def copy_bandwidth():
    """The device's copy ceiling, GB/s: the fastest of 20 passes over 1 GiB (read + write) after 100
    passes of warm-up. A median of 7 after 2 passes read 1590-2973 GB/s on the same H200 between
    processes (cause not established), which made the phase tables' '% of copy' column meaningless."""
    x = mx.random.normal((1 << 29,)).astype(mx.float16)  # 1 GiB
    mx.eval(x)
    return 2 * x.nbytes / timeit(lambda: x * 1.5, reps=20, warmup=100, stat=min) / 1e9


def packed(N, K, bits=4, gs=64, dtype=mx.bfloat16):
    wq, s, b = mx.quantize(mx.random.normal((N, K)) * 0.05, group_size=gs, bits=bits)
    return PackedLinear(wq, s.astype(dtype), b.astype(dtype), None, (N,), K, bits, gs)


def gemv_case(label, M, K, N, epi=0, bits=4, norm=False, head=False):
    """stock quantized_matmul (+ its norm / swiglu) vs our GEMV; head: vs the lm_head op instead
    (the GEMV at one row, the tensor-core qmm from gemv.HEAD_QMM_FROM rows)."""
    w0 = packed(N * (2 if epi == 2 else 1), K, bits)
    wbytes = w0.weight.nbytes + w0.scales.nbytes + w0.biases.nbytes
    copies = max(1, min(16, -(-200_000_000 // wbytes)))
    ws = [w0] + [packed(N * (2 if epi == 2 else 1), K, bits) for _ in range(copies - 1)]
    x = mx.random.normal((M, K)).astype(mx.bfloat16)
    nw = (1 + 0.1 * mx.random.normal((K,))).astype(mx.bfloat16)
    mx.eval(x, nw, [(w.weight, w.scales, w.biases) for w in ws])

    def stock():
        outs = []
        for i in range(CALLS):
            w = ws[i % copies]
            xi = mx.fast.rms_norm(x, nw, 1e-6) if norm else x
            y = mx.quantized_matmul(xi, w.weight, w.scales, w.biases, transpose=True, group_size=64, bits=bits)
            if epi == 2:
                g, u = mx.split(y, 2, axis=-1)
                y = mx.sigmoid(g) * g * u
            outs.append(y)
        return outs

    def ours():
        if head:
            return [gemv.lm_head(x, ws[i % copies]) for i in range(CALLS)]
        return [gemv.gemv(x, ws[i % copies], epi=epi, norm=(nw, 1e-6) if norm else None) for i in range(CALLS)]

    return timings(label, stock, ours, wbytes + x.nbytes + M * N * 2, M=M, K=K, N=N, bits=bits)


def attn_case(label, H, HKV, D, length, S=None):
    S = S or -(-length // 256) * 256
    B = 1
    copies = max(1, min(16, -(-200_000_000 // (2 * HKV * S * D * 2))))
    kvs = [(mx.random.normal((B, HKV, S, D)).astype(mx.bfloat16), mx.random.normal((B, HKV, S, D)).astype(mx.bfloat16))
           for _ in range(copies)]
    q = mx.random.normal((B, H, 1, D)).astype(mx.bfloat16)
    mx.eval(q, kvs)
    off = source.offset_array(length - 1)
    q4 = q.reshape(B, 1, H, D)

    def stock():
        return [mx.fast.scaled_dot_product_attention(q, k[..., :length, :], v[..., :length, :], scale=D ** -0.5)
                for k, v in (kvs[i % copies] for i in range(CALLS))]

    def ours():
        return [attention.attention(q4, k, v, off, D ** -0.5) for k, v in (kvs[i % copies] for i in range(CALLS))]

    return timings(label, stock, ours, 2 * B * HKV * length * D * 2, H=H, HKV=HKV, D=D, length=length)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/cuda_kernels", help="writes OUT.md and OUT.json")
    ap.add_argument("--only", default="", help="run the cases whose label contains this")
    ap.add_argument("--calls", type=int, default=64, help="calls per graph (1 for a profiler)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--wall-only", action="store_true", help="no CUPTI GPU times (under ncu, which holds CUPTI)")
    a = ap.parse_args()
    global CALLS, REPS, WALL_ONLY
    CALLS, REPS, WALL_ONLY = a.calls, a.reps, a.wall_only
    if not mx.cuda.is_available():
        sys.exit("cuda_kernels: MLX's CUDA backend is not available here")
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw:.0f} GB/s", flush=True)
    rows = []
    cases = [
        ("0.6B qkv", 1, 1024, 4096, 0), ("0.6B o_proj", 1, 2048, 1024, 0), ("0.6B gate_up+silu", 1, 1024, 3072, 2),
        ("0.6B norm+qkv", 1, 1024, 4096, 0, 4, True), ("0.6B norm+gate_up+silu", 1, 1024, 3072, 2, 4, True),
        ("0.6B down", 1, 3072, 1024, 0), ("0.6B lm_head", 1, 1024, 151936, 0),
        ("4B gate_up+silu", 1, 2560, 9728, 2), ("4B down", 1, 9728, 2560, 0), ("4B lm_head", 1, 2560, 151936, 0),
        ("8B qkv", 1, 4096, 6144, 0), ("8B gate_up+silu", 1, 4096, 12288, 2), ("8B down", 1, 12288, 4096, 0),
        ("8B down M=4", 4, 12288, 4096, 0), ("0.6B qkv 8-bit", 1, 1024, 4096, 0, 8),
        ("0.6B lm_head M=4", 4, 1024, 151936, 0, 4, False, True), ("4B lm_head M=4", 4, 2560, 151936, 0, 4, False, True),
        ("8B lm_head M=8", 8, 4096, 151936, 0, 4, False, True),
    ]
    for c in cases:
        if a.only not in c[0]:
            continue
        r = gemv_case(*c)
        rows.append(r)
        print(r, flush=True)
    for c in [("0.6B attn ctx 640", 16, 8, 128, 640), ("0.6B attn ctx 2176", 16, 8, 128, 2176),
              ("8B attn ctx 8192", 32, 8, 128, 8192), ("llama-1B attn ctx 2176", 32, 8, 64, 2176)]:
        if a.only not in c[0]:
            continue
        r = attn_case(*c)
        rows.append(r)
        print(r, flush=True)
    m = machine()
    meta = {"device": m.get("gpu") or m["device"], "mlx": m["mlx"], "mlx_lm": m["mlx_lm"], "commit": m["commit"],
            "source": m["sources"], "copy_GBs": bw, "calls_per_graph": CALLS, "reps": REPS}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    out.with_suffix(".md").write_text(markdown(rows, meta))
    print(markdown(rows, meta))


def markdown(rows, meta):
    bw = meta["copy_GBs"]
    gpu = all("ours_gpu_us" in r for r in rows)
    key = "gpu" if gpu else "wall"
    lines = ["# CUDA kernel microbenchmarks", "", f"device {meta['device']}; mlx {meta['mlx']}, mlx-lm {meta['mlx_lm']}; "
             f"commit {meta['commit']} (sources {meta['source']}); measured copy bandwidth {bw:.0f} GB/s; {meta['calls_per_graph']} calls per "
             f"evaluated graph; wall: median of {meta['reps']}" + ("; GPU: summed kernel durations (CUPTI), median of 3"
                                                           if gpu else "") + f". GB/s and speed-up of the {key} times.", "",
             "| case | stock wall us | ours wall us |" + (" stock GPU us | ours GPU us |" if gpu else "") +
             " stock GB/s | ours GB/s | ours % of copy BW | speed-up |",
             "| --- | --- | --- |" + (" --- | --- |" if gpu else "") + " --- | --- | --- | --- |"]
    for r in rows:
        g = f" {r['stock_gpu_us']:.1f} | {r['ours_gpu_us']:.1f} |" if gpu else ""
        lines.append(f"| {r['case']} | {r['stock_wall_us']:.1f} | {r['ours_wall_us']:.1f} |{g} {r['stock_GBs']:.0f} | "
                     f"{r['ours_GBs']:.0f} | {100 * r['ours_GBs'] / bw:.0f}% | "
                     f"{r[f'stock_{key}_us'] / r[f'ours_{key}_us']:.2f}x |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
