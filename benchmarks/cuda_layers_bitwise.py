"""Do several decoder layers in one launch compute exactly what one launch per layer computes, on the GPU?

    python3 benchmarks/cuda_layers_bitwise.py [--layers qwen3-0.6b:8:3,...] [--decode qwen3-0.6b,...]
        [--disable NAMES] [--out benchmarks/results/cuda_layers_bitwise]

1. Layer launches (--layers, name:layers:trials): a synthetic model of that many real-size layers,
   random x and random caches (600+ positions), all its layers in one launch (layers_launch) against
   each layer's own launch, twice: trials whose output differs at all, trials whose rerun differs,
   and (layer, trial) pairs whose written cache rows differ. --disable (e.g. layer_loop) patches
   with those fusions off; the comparison is the same.
2. Decode (--decode): teacher-forced logits (fidelity.forced_logits: a 64-token prompt, then 24
   steps through the compiled decode step) of the default grouping against one layer per launch
   (layer_groups off) and against layer_loop off, each run twice: elements that differ.

Why: with one call site per layer and phase, NVRTC calls out-of-line copies of phases in long
launches (8 layers; none up to 5), and those round differently (backends/cuda.py, _loop_body).
Needs MLX's CUDA backend (the CPU emulator cannot run these sizes in useful time).
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx
import numpy as np

import mlx_fastops
from mlx_fastops import fidelity, synthetic_model
from mlx_fastops.backends import cuda as C


def differ(a, b):
    """Elements of a and b that differ."""
    return int((np.asarray(a.astype(mx.float32)) != np.asarray(b.astype(mx.float32))).sum())


def layer_mismatches(name, layers, trials, disable=(), batch=1):
    """{out, rerun, cache}: trials whose one-launch output differs from per-layer launches, trials
    whose second one-launch run differs from its first, (layer, trial) pairs whose cache differs."""
    model = synthetic_model(name, bits=4, layers=layers, dtype=mx.bfloat16)
    mlx_fastops.patch(model, disable=("compile", *disable))
    try:
        fbs = [layer.fast_fn for layer in model.model.layers]
        D, HKV, K = fbs[0].D, fbs[0].HKV, model.args.hidden_size
        bad = {"out": 0, "rerun": 0, "cache": 0}
        for t in range(trials):
            caches = [[mx.random.normal((batch, HKV, 1024, D)).astype(mx.bfloat16) for _ in range(2)] for _ in fbs]
            x = (4 * mx.random.normal((batch, 1, K))).astype(mx.bfloat16)
            off = C.offset_array(600 + 37 * t)
            res = []
            for together in (False, True, True):
                bufs = [(kc + 0, vc + 0) for kc, vc in caches]
                mx.eval(bufs)
                if together:
                    out, o = C.layers_launch(fbs, x, off, [(kc, vc, kc) for kc, vc in bufs])
                else:
                    out = x
                    for fb, (kc, vc) in zip(fbs, bufs):
                        out, o = fb.core(out, off, kc, vc, kc)
                mx.eval(out, o)
                res.append((out, bufs))
            bad["out"] += differ(res[0][0], res[1][0]) > 0
            bad["rerun"] += differ(res[1][0], res[2][0]) > 0
            bad["cache"] += sum(differ(a[0], b[0]) + differ(a[1], b[1]) > 0 for a, b in zip(res[0][1], res[1][1]))
        return bad
    finally:
        mlx_fastops.unpatch(model)


def decode_mismatches(name, steps=24, layers=None):
    """{variant: (elements != the default's first run, for its run 1 and run 2; run 1 vs run 2)}."""
    prompt = mx.random.randint(0, 1000, (64,), key=mx.random.key(1))
    toks = mx.random.randint(0, 1000, (steps,), key=mx.random.key(2))
    out = {}
    for disable in ((), ("layer_groups",), ("layer_loop",)):
        m = synthetic_model(name, bits=4, layers=layers)
        mlx_fastops.patch(m, disable=disable)
        per = max(n for _, n in C.launch_runs(m.model._fastops_blocks))
        runs = [fidelity.forced_logits(m, prompt, toks) for _ in range(2)]
        mx.eval(runs)
        out[f"{','.join(disable) or 'default'} ({per} per launch)"] = runs
        del m
    ref = next(iter(out.values()))[0]
    return {k: (differ(ref, a), differ(ref, b), differ(a, b)) for k, (a, b) in out.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", default="qwen3-0.6b:8:3,qwen3-0.6b:28:2,llama-3.2-1b:16:3")
    ap.add_argument("--decode", default="qwen3-0.6b,llama-3.2-1b")
    ap.add_argument("--disable", default="", help="fusions off in the layer-launch comparison")
    ap.add_argument("--out", default="benchmarks/results/cuda_layers_bitwise")
    a = ap.parse_args()
    os.environ["MLX_FASTOPS_BACKEND"] = "cuda"
    disable = tuple(n for n in a.disable.split(",") if n)
    t0 = time.perf_counter()
    res = {"mlx": mx.__version__, "disable": disable, "layers": [], "decode": {}}
    lines = ["# Several layers in one launch vs one launch per layer, bit for bit", "",
             f"mlx {mx.__version__}; disabled: {','.join(disable) or '-'}", "",
             "| model | layers in the launch | trials | output differs | rerun differs | (layer, trial) caches differ |",
             "| --- | --- | --- | --- | --- | --- |"]
    for case in filter(None, a.layers.split(",")):
        name, n, trials = case.split(":")
        bad = layer_mismatches(name, int(n), int(trials), disable)
        res["layers"].append({"model": name, "layers": int(n), "trials": int(trials), **bad})
        lines.append(f"| {name} | {n} | {trials} | {bad['out']} | {bad['rerun']} | {bad['cache']} |")
        print(lines[-1], f"({time.perf_counter() - t0:.0f} s)", flush=True)
    lines += ["", "Decode logits (24 teacher-forced steps), elements that differ from the default's first run:",
              "", "| model | variant | run 1 | run 2 | run 1 vs run 2 |", "| --- | --- | --- | --- | --- |"]
    for name in filter(None, a.decode.split(",")):
        res["decode"][name] = decode_mismatches(name)
        for k, v in res["decode"][name].items():
            lines.append(f"| {name} | {k} | {v[0]} | {v[1]} | {v[2]} |")
            print(lines[-1], f"({time.perf_counter() - t0:.0f} s)", flush=True)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
