"""Host cost of decode on MLX's CUDA backend: what a launch costs the host, and where a step's host
time goes.

    python3 benchmarks/cuda_host.py [--models qwen3-0.6b,qwen3-4b] [--reps 5] [--group-all] [--profile]
        [--skip-launch] [--out benchmarks/results/cuda_host]

1. Per launch: a chain of 36 launches of a one-thread custom kernel whose source is padded to
   1-96 KB (MLX hashes a custom kernel's whole source at every launch), beside a chain of 36 stock
   elementwise adds; graph build (Python) and evaluation timed apart, median of --reps x 10 chains.
2. Per model: decode through mlx_fastops.bench (tg after --prompt tokens, the variants in rotating
   order) of stock, patched, patched without the compiled step (compile) and without the fused
   layer (fast_decode), and with --group-all a copy with every layer in one launch at every row
   count and the small layers' phase choices (the GROUP_MAX_WEIGHTS bound lifted; patched, large
   layers share one launch at one row only: step.LARGE_SHARED_MAX_ROWS); beside each, one
   unpipelined decode step: graph build (the model call, nothing evaluated) and its evaluation,
   medians over 24 steps.
3. With --profile: cProfile of the patched model's step builds (each step evaluated outside the
   profile), the functions by own time.
"""

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

import mlx_fastops
from mlx_fastops import bench, synthetic_model
from mlx_fastops.backends.cuda import block

CHAIN = 36


def chain_cost(launch, reps):
    """(build us, eval us) per op of a chain of CHAIN calls of launch(y) -> y, median over reps chains."""
    x = mx.zeros((1,), mx.float32)
    builds, evals = [], []
    for r in range(reps + 2):
        t0 = time.perf_counter()
        y = x
        for _ in range(CHAIN):
            y = launch(y)
        t1 = time.perf_counter()
        mx.eval(y)
        t2 = time.perf_counter()
        assert y.item() == CHAIN, y.item()
        if r >= 2:
            builds.append((t1 - t0) * 1e6 / CHAIN)
            evals.append((t2 - t1) * 1e6 / CHAIN)
    return statistics.median(builds), statistics.median(evals)


def padded_kernel(pad_kb):
    pad = ("// " + "x" * 76 + "\n") * (pad_kb * 1024 // 80)
    k = mx.fast.cuda_kernel(name=f"host_probe_{pad_kb}", input_names=["a"], output_names=["b"],
                            header=pad, source="if (threadIdx.x == 0) b[0] = a[0] + 1.0f;")
    return lambda y: k(inputs=[y], output_shapes=[(1,)], output_dtypes=[mx.float32], grid=(32, 1, 1),
                       threadgroup=(32, 1, 1))[0]


def host_split(model, prompt, steps=24, profile=None):
    """Per unpipelined decode step: (graph build ms, evaluation ms), medians over the last 3/4 of
    `steps`. With `profile` (a cProfile.Profile) each build runs under it."""
    cache = make_prompt_cache(model)
    y = mx.argmax(model(prompt[None], cache=cache)[:, -1, :], axis=-1)
    mx.eval(y)
    builds, evals = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        if profile:
            profile.enable()
        y = mx.argmax(model(y[:, None], cache=cache)[:, -1, :], axis=-1)
        if profile:
            profile.disable()
        t1 = time.perf_counter()
        mx.eval(y)
        builds.append((t1 - t0) * 1e3)
        evals.append((time.perf_counter() - t1) * 1e3)
    k = steps // 4
    return statistics.median(builds[k:]), statistics.median(evals[k:])


def variants(name, group_all):
    """[(name, model, None)] for bench.compare, each copy patched once (same seed: same weights)."""
    out = [("stock", synthetic_model(name, bits=4), None)]
    for label, disable in (("patched", ""), ("without compile", "compile"), ("without fast_decode", "fast_decode")):
        m = synthetic_model(name, bits=4)
        mlx_fastops.patch(m, disable=disable, tune="off")   # every kernel, untuned
        out.append((label, m, None))
    if group_all:
        saved = block.GROUP_MAX_WEIGHTS
        block.GROUP_MAX_WEIGHTS = 1 << 40   # read when the FastBlocks are made, at patch time
        try:
            m = synthetic_model(name, bits=4)
            mlx_fastops.patch(m, tune="off")
        finally:
            block.GROUP_MAX_WEIGHTS = saved
        out.append(("every layer in one launch", m, None))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen3-0.6b,qwen3-4b")
    ap.add_argument("--reps", type=int, default=5, help="decode trials (launch chains: 10x as many)")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--group-all", action="store_true", help="add a copy with every layer in one launch, as small layers")
    ap.add_argument("--skip-launch", action="store_true", help="no launch-cost chains")
    ap.add_argument("--profile", action="store_true", help="cProfile the patched model's step builds")
    ap.add_argument("--out", default="benchmarks/results/cuda_host", help="writes OUT.md and OUT.json")
    a = ap.parse_args()
    if not mx.cuda.is_available():
        sys.exit("cuda_host: MLX's CUDA backend is not available here")
    os.environ["MLX_FASTOPS_BACKEND"] = "cuda"
    m = bench.machine()
    res = {"machine": m, "launch": {}, "decode": {}}
    lines = ["# Host cost of decode on MLX CUDA", "",
             f"{m.get('gpu') or m['device']}; mlx {m['mlx']}; commit {m['commit']} (sources {m['sources']})", ""]
    if not a.skip_launch:
        lines += [f"## One op, by kind (chain of {CHAIN}, us per op)", "", "| op | build | eval |", "| --- | --- | --- |"]
        cases = [("stock add", lambda y: y + 1)] + [(f"custom kernel, {kb} KB source", padded_kernel(kb))
                                                      for kb in (1, 16, 32, 56, 96)]
        for label, launch in cases:
            b, e = chain_cost(launch, a.reps * 10)
            res["launch"][label] = {"build_us": b, "eval_us": e}
            lines.append(f"| {label} | {b:.1f} | {e:.1f} |")
            print(lines[-1], flush=True)
        lines.append("")
    for name in a.models.split(","):
        vs = variants(name, a.group_all)
        rows = bench.compare(vs, [a.prompt], a.gen, trials=a.reps, progress=lambda t: print(name, t, flush=True))
        tg = rows[-1]["variants"]
        prompt = mx.random.randint(0, vs[0][1].args.vocab_size, (a.prompt,), key=mx.random.key(a.prompt))
        split = {label: host_split(model, prompt) for label, model, _ in vs}
        res["decode"][name] = {label: {"tg": tg[label], "build_ms": split[label][0], "eval_ms": split[label][1]}
                               for label in tg}
        table = [f"## {name} Q4, tg{a.gen} after {a.prompt} tokens ({a.reps} trials, rotating)", "",
                 "| variant | tok/s median (min-max) | ratio | build ms | eval ms | greedy agreement with stock |",
                 "| --- | --- | --- | --- | --- | --- |"]
        for label, v in tg.items():
            agree = f"{v['agreement']['matching']}/{v['agreement']['tokens']}" if "agreement" in v else "-"
            table.append(f"| {label} | {v['median']:.1f} ({v['min']:.1f}-{v['max']:.1f}) | {v['ratio']:.2f}x | "
                         f"{split[label][0]:.2f} | {split[label][1]:.2f} | {agree} |")
        lines += table + [""]
        print("\n".join(table), flush=True)
        if a.profile:
            prof = cProfile.Profile()
            host_split(vs[1][1], prompt, 48, profile=prof)
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
            lines += [f"### {name}: graph build of 48 patched decode steps, cProfile by own time", "", "```",
                      text.getvalue().strip(), "```", ""]
        del vs
        mx.clear_cache()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
