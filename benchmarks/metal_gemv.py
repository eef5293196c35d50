"""Microbenchmark of the Metal quantised GEMV family against the stock calls each kernel replaces.

Run on an Apple-silicon Mac (Metal); not runnable elsewhere (no Metal timings exist for this code
yet: everything in this repository about these kernels is emulator-verified only).

    python benchmarks/metal_gemv.py                       # all kernels, Qwen3-0.6B/4B + Llama-3.2-1B shapes
    python benchmarks/metal_gemv.py --kernel qkv --model qwen3-0.6b --rows 1 2 4 --bits 4 8
    python benchmarks/metal_gemv.py --check-only          # outputs vs stock, no timing

Per (kernel, model shape, bits, rows) it times, alternating A/B/C each trial after warm-up:
  stock      the calls mlx-lm makes today: qkv = 3 x mx.quantized_matmul; gate_up = 2 x
             quantized_matmul + mlx-lm's compiled swiglu; lm_head = 1 x quantized_matmul
  stacked    the zero-kernel baseline: stacked weights + one quantized_matmul (+ split / swiglu),
             i.e. mlx_fastops' reference op (what MLX_FASTOPS_BACKEND=reference runs)
  kernel     our kernel (metal/gemv.metal)
Each sample evaluates `--reps` independent calls (distinct inputs) in one graph and divides, so the
per-call figure includes dispatch but not a full command-buffer round trip. Reported: median time per
call (us) with min/max, achieved GB/s (weights + scales/biases + activations + outputs, bytes / time),
and the speed-up of each candidate over stock. Results go to benchmarks/results/metal_gemv-<time>.{md,json}.
"""

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlx_fastops.backends import reference  # noqa: E402
from mlx_fastops.backends.metal import gemv as G  # noqa: E402
from mlx_fastops.bench import machine  # noqa: E402
from mlx_fastops.ops.weights import PackedLinear  # noqa: E402

# hidden, q out, kv out, intermediate, vocab (real configs)
MODELS = {
    "qwen3-0.6b": dict(hidden=1024, q=2048, kv=1024, inter=3072, vocab=151936),
    "qwen3-4b": dict(hidden=2560, q=4096, kv=1024, inter=9728, vocab=151936),
    "llama-3.2-1b": dict(hidden=2048, q=2048, kv=512, inter=8192, vocab=128256),
}
# --emulate smoke test only (the script's own plumbing; CPU-emulator timings mean nothing)
TINY = {"tiny": dict(hidden=256, q=64, kv=32, inter=48, vocab=96)}
KERNELS = ("qkv", "gate_up", "lm_head")


def make_layers(sizes, k, bits, group, dtype):
    layers = []
    for n in sizes:
        lin = nn.Linear(k, n, bias=False)
        lin.set_dtype(dtype)
        layers.append(nn.QuantizedLinear.from_linear(lin, group, bits))
    mx.eval([l.parameters() for l in layers])
    return layers


def stock_call(kind, layers):
    from mlx_lm.models.activations import swiglu

    if kind == "qkv":
        q, k, v = layers
        return lambda x: (q(x), k(x), v(x))
    if kind == "gate_up":
        g, u = layers
        return lambda x: swiglu(g(x), u(x))
    (h,) = layers
    return lambda x: h(x)


def candidates(kind, layers):
    """name -> fn(x). Stacking rebinds the stock layers to row views of the stacked arrays (as the
    patcher does); the views are contiguous, so the stock calls read the same bytes as before."""
    w = PackedLinear.stack(layers)
    stock = stock_call(kind, layers)
    ref = {"qkv": reference.qkv_proj, "gate_up": reference.gate_up_silu, "lm_head": reference.lm_head}[kind]
    ours = {"qkv": G.qkv_proj, "gate_up": G.gate_up_silu, "lm_head": G.gemv}[kind]
    return w, {
        "stock": stock,
        "stacked": lambda x: ref(x, w),
        "kernel": lambda x: ours(x, w),
    }


def bytes_moved(w, rows, k, n_out, itemsize):
    return (w.weight.nbytes + w.scales.nbytes + w.biases.nbytes + rows * k * itemsize
            + rows * n_out * itemsize)


def flatten(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]


def check(fns, xs, dtype):
    base = [o.astype(mx.float32) for o in flatten(fns["stock"](xs[0]))]
    res = {}
    for name, fn in fns.items():
        outs = [o.astype(mx.float32) for o in flatten(fn(xs[0]))]
        err = max(float(mx.abs(a - b).max() / mx.maximum(mx.abs(b).max(), 1e-6)) for a, b in zip(outs, base))
        res[name] = err
    return res


def time_one(fn, xs):
    """Seconds per call: graph construction (our wrappers' Python included) + GPU execution."""
    mx.synchronize()
    t = time.perf_counter()
    mx.eval([fn(x) for x in xs])
    mx.synchronize()
    return (time.perf_counter() - t) / len(xs)


def bench_case(kind, model, bits, group, dtype, rows, reps, trials, warmup):
    cfg = MODELS[model]
    k = cfg["hidden"]
    sizes = {"qkv": (cfg["q"], cfg["kv"], cfg["kv"]), "gate_up": (cfg["inter"], cfg["inter"]),
             "lm_head": (cfg["vocab"],)}[kind]
    layers = make_layers(sizes, k, bits, group, dtype)
    w, fns = candidates(kind, layers)
    xs = [mx.random.normal((1, rows, k)).astype(dtype) for _ in range(reps)]
    mx.eval(xs)
    errors = check(fns, xs, dtype)
    names = list(fns)
    samples = {n: [] for n in names}
    for trial in range(warmup + trials):
        order = names if trial % 2 == 0 else names[::-1]
        for n in order:
            t = time_one(fns[n], xs)
            if trial >= warmup:
                samples[n].append(t)
    n_out = sizes[0] if kind == "gate_up" else sum(sizes)
    moved = bytes_moved(w, rows, k, n_out, mx.zeros((), dtype).itemsize)
    stock_med = statistics.median(samples["stock"])
    row = {"kernel": kind, "model": model, "bits": bits, "group": group, "dtype": str(dtype).split(".")[-1],
           "rows": rows, "shape": {"in": k, "out": list(sizes)}, "bytes": moved, "max_rel_err_vs_stock": errors,
           "results": {}}
    for n in names:
        med = statistics.median(samples[n])
        row["results"][n] = {"median_us": med * 1e6, "min_us": min(samples[n]) * 1e6,
                             "max_us": max(samples[n]) * 1e6, "gb_s": moved / med / 1e9,
                             "speedup_vs_stock": stock_med / med}
    return row


def to_markdown(rows, info):
    lines = [f"Metal GEMV microbenchmark: {info.get('device_info', {}).get('device_name', info['device'])}, "
             f"mlx {info['mlx']}, mlx-lm {info['mlx_lm']}", "",
             "| kernel | model | bits | g | dtype | rows | stock us | stacked us | kernel us "
             "| kernel GB/s | kernel x stock | max rel err (kernel) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        res = r["results"]
        lines.append(
            f"| {r['kernel']} | {r['model']} | {r['bits']} | {r['group']} | {r['dtype']} | {r['rows']} "
            f"| {res['stock']['median_us']:.1f} | {res['stacked']['median_us']:.1f} "
            f"| {res['kernel']['median_us']:.1f} | {res['kernel']['gb_s']:.0f} "
            f"| {res['kernel']['speedup_vs_stock']:.2f} | {r['max_rel_err_vs_stock']['kernel']:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kernel", nargs="+", default=list(KERNELS), choices=KERNELS)
    p.add_argument("--model", nargs="+", default=list(MODELS), choices=list(MODELS) + list(TINY))
    p.add_argument("--bits", nargs="+", type=int, default=[4, 8], choices=[4, 8])
    p.add_argument("--group", type=int, default=64, choices=[32, 64, 128])
    p.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16"])
    p.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8])
    p.add_argument("--reps", type=int, default=16, help="independent calls per timed graph")
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--check-only", action="store_true", help="compare outputs with stock, no timing")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--emulate", action="store_true",
                   help="smoke-test this script on the CPU emulator with tiny shapes (no real timings)")
    a = p.parse_args(argv)
    if a.emulate:
        sys.path.insert(0, str(ROOT / "tests"))
        import metal_emu

        from mlx_fastops import kernels

        metal_emu.config.schedules = "min"
        MODELS.clear()
        MODELS.update(TINY)
        a.model, a.reps, a.trials, a.warmup = ["tiny"], 2, 2, 1
        with kernels.use_metal_factory(metal_emu.metal_kernel):
            return run(a)
    if not mx.metal.is_available():
        sys.exit("metal_gemv.py needs Metal (an Apple-silicon Mac); on Linux the kernels are only "
                 "emulator-verified (pytest tests/test_ops.py -m metal).")
    return run(a)


def run(a):
    dtype = getattr(mx, a.dtype)
    rows = []
    for kind in a.kernel:
        for model in a.model:
            for bits in a.bits:
                for m in a.rows:
                    if a.check_only:
                        cfg = MODELS[model]
                        sizes = {"qkv": (cfg["q"], cfg["kv"], cfg["kv"]), "gate_up": (cfg["inter"],) * 2,
                                 "lm_head": (cfg["vocab"],)}[kind]
                        _, fns = candidates(kind, make_layers(sizes, cfg["hidden"], bits, a.group, dtype))
                        x = mx.random.normal((1, m, cfg["hidden"])).astype(dtype)
                        print(kind, model, bits, m, check(fns, [x], dtype))
                        continue
                    r = bench_case(kind, model, bits, a.group, dtype, m, a.reps, a.trials, a.warmup)
                    res = r["results"]
                    print(f"{kind:8s} {model:13s} q{bits} m{m}: " + "  ".join(
                        f"{n} {v['median_us']:.1f}us ({v['speedup_vs_stock']:.2f}x)" for n, v in res.items()),
                        flush=True)
                    rows.append(r)
    if a.check_only:
        return
    info = machine()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    md = to_markdown(rows, info)
    (out / f"metal_gemv-{stamp}.md").write_text(md)
    (out / f"metal_gemv-{stamp}.json").write_text(json.dumps({"machine": info, "rows": rows}, indent=1))
    print(md)


if __name__ == "__main__":
    main()
