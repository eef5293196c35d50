"""Where a decode step's time goes on MLX CUDA (host vs GPU, per-op cost). Prints a table.

    python3 benchmarks/cuda_probe.py [--model qwen3-0.6b]

1. Per-op cost of a dependent chain of 150 tiny ops: stock elementwise vs mx.fast.cuda_kernel.
2. One decode step of the model, unpipelined (Python graph build, then mx.eval), and the pipelined
   step time of mlx-lm's generate_step, for: stock; patched with each fast-path switch off.
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx

import mlx_fastops
from mlx_fastops import synthetic_model
from cuda_bench import host_split, run_once


def chain_cost(n=150):
    x = mx.random.normal((1024,)).astype(mx.bfloat16)
    k = mx.fast.cuda_kernel(name="probe_add", input_names=["a"], output_names=["b"],
                            source="int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < 1024) b[i] = a[i] + T(1.0f);".replace("T(", "__nv_bfloat16("))

    def stock():
        y = x
        for _ in range(n):
            y = y + 1
        return y

    def custom():
        y = x
        for _ in range(n):
            y = k(inputs=[y], output_shapes=[(1024,)], output_dtypes=[mx.bfloat16], grid=(1024, 1, 1), threadgroup=(256, 1, 1))[0]
        return y

    out = {}
    for name, fn in (("stock add", stock), ("custom kernel", custom)):
        mx.eval(fn())
        bs, es = [], []
        for _ in range(9):
            t0 = time.perf_counter()
            y = fn()
            t1 = time.perf_counter()
            mx.eval(y)
            t2 = time.perf_counter()
            bs.append((t1 - t0) / n * 1e6)
            es.append((t2 - t1) / n * 1e6)
        out[name] = (statistics.median(bs), statistics.median(es))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    a = ap.parse_args()
    for name, (b, e) in chain_cost().items():
        print(f"chain of 150 dependent {name:14s}: build {b:6.2f} us/op, eval {e:6.2f} us/op", flush=True)
    os.environ["MLX_FASTOPS_BACKEND"] = "cuda"
    model = synthetic_model(a.model, bits=4)
    prompt = mx.random.randint(0, model.args.vocab_size, (512,), key=mx.random.key(1))
    rows = []
    for label, disable in (("stock", None), ("patched", ()), ("patched, compile off", ("compile",)),
                           ("patched, fast_decode off", ("fast_decode",))):
        if disable is not None:
            mlx_fastops.patch(model, disable=disable)
        run_once(model, prompt, 8)
        b, e = host_split(model, prompt)
        tg = statistics.median([run_once(model, prompt, 64)[1] for _ in range(2)])
        rows.append((label, b, e, 1e3 / tg, tg))
        print(f"{label:26s} build {b:.2f} ms  eval {e:.2f} ms  pipelined {1e3 / tg:.2f} ms/step ({tg:.0f} tok/s)", flush=True)
        if disable is not None:
            mlx_fastops.unpatch(model)
    print("\n| variant | build ms | eval ms | pipelined ms/step | tok/s |\n| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r[0]} | {r[1]:.2f} | {r[2]:.2f} | {r[3]:.2f} | {r[4]:.0f} |")


if __name__ == "__main__":
    main()
