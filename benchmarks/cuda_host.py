"""Host cost of decode on MLX's CUDA backend: what a launch costs the host, and what fewer launches buy.

    python3 benchmarks/cuda_host.py [--models qwen3-4b,qwen3-8b] [--reps 5] [--out benchmarks/results/cuda_host]

1. Per custom-kernel launch: a chain of 36 launches of a one-thread kernel whose source is padded
   to 1-96 KB (MLX hashes a CUDA kernel's whole source at every launch), graph build (Python) and
   evaluation timed apart, median of --reps x 10 chains.
2. Decode, pipelined (mlx-lm's generate_step, tg128 after 512 prompt tokens): patched as by
   default (one layer per launch above GROUP_MAX_WEIGHTS, else all of them in one) against the
   same model with at most --groups layers per launch (the weight limit lifted), rotating in one
   process, with the unpipelined host split (graph build vs evaluation) of each. Small models:
   `--skip-launch --models qwen3-0.6b,llama-3.2-1b --groups 1,4,7` (cuda_visit.sh groups).
3. With --profile: where the default variant's graph build goes, cProfile of unpipelined decode
   steps (build only, each step evaluated outside the profile), the functions by own time.
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx

import mlx_fastops
from mlx_fastops import synthetic_model
from mlx_fastops.backends import cuda as C
from cuda_bench import device_name, host_split, run_once, source_digest, stats

CHAIN = 36


def launch_cost(pad_kb, reps):
    """(build us, eval us) per launch, median over reps chains of CHAIN launches."""
    pad = ("// " + "x" * 76 + "\n") * (pad_kb * 1024 // 80)
    k = mx.fast.cuda_kernel(name=f"host_probe_{pad_kb}", input_names=["a"], output_names=["b"],
                            header=pad, source="if (threadIdx.x == 0) b[0] = a[0] + 1.0f;")
    x = mx.zeros((1,), mx.float32)
    builds, evals = [], []
    for r in range(reps + 2):
        t0 = time.perf_counter()
        y = x
        for _ in range(CHAIN):
            y = k(inputs=[y], output_shapes=[(1,)], output_dtypes=[mx.float32], grid=(32, 1, 1),
                  threadgroup=(32, 1, 1))[0]
        t1 = time.perf_counter()
        mx.eval(y)
        t2 = time.perf_counter()
        assert y.item() == CHAIN, y.item()
        if r >= 2:
            builds.append((t1 - t0) * 1e6 / CHAIN)
            evals.append((t2 - t1) * 1e6 / CHAIN)
    return statistics.median(builds), statistics.median(evals)


def build_profile(model, prompt, steps=48, top=25):
    """The top functions by own time over `steps` unpipelined decode-step graph builds (host_split's
    steps, each evaluated unprofiled)."""
    prof = cProfile.Profile()
    host_split(model, prompt, steps, profile=prof)
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def grouped_copy(name, layers_per_launch):
    """A patched synthetic model whose layers share launches layers_per_launch at a time."""
    saved = C.GROUP_MAX_WEIGHTS, C.LAYERS_PER_LAUNCH
    C.GROUP_MAX_WEIGHTS, C.LAYERS_PER_LAUNCH = 1 << 40, layers_per_launch
    try:
        m = synthetic_model(name, bits=4)
        mlx_fastops.patch(m)
    finally:
        C.GROUP_MAX_WEIGHTS, C.LAYERS_PER_LAUNCH = saved
    return m


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="qwen3-4b,qwen3-8b")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--groups", default="2,4", help="layers per launch of the grouped variants")
    ap.add_argument("--skip-launch", action="store_true")
    ap.add_argument("--profile", action="store_true", help="cProfile the default variant's step builds")
    ap.add_argument("--out", default="benchmarks/results/cuda_host")
    a = ap.parse_args()
    os.environ["MLX_FASTOPS_BACKEND"] = "cuda"
    res = {"device": device_name(), "mlx": mx.__version__, "sources": source_digest(), "launch": {}, "decode": {}}
    lines = ["# Host cost of decode on MLX CUDA", "", f"device {res['device']}; mlx {res['mlx']}; "
             f"sources {res['sources']}", ""]
    if not a.skip_launch:
        lines += [f"## One launch, by source length (chain of {CHAIN}, us per launch)", "",
                  "| source KB | build | eval |", "| --- | --- | --- |"]
        for kb in (1, 16, 32, 56, 96):
            b, e = launch_cost(kb, a.reps * 10)
            res["launch"][kb] = {"build_us": b, "eval_us": e}
            lines.append(f"| {kb} | {b:.1f} | {e:.1f} |")
            print(lines[-1], flush=True)
        lines.append("")
    for name in a.models.split(","):
        default = synthetic_model(name, bits=4)
        mlx_fastops.patch(default)
        per = max(n for _, n in C.launch_runs([layer.fast_fn for layer in default.model.layers]))
        variants = [(f"default, {per} per launch", default)]
        variants += [(f"{n} layers per launch", grouped_copy(name, int(n))) for n in a.groups.split(",") if n]
        vocab = variants[0][1].args.vocab_size
        prompt = mx.random.randint(0, vocab, (a.prompt,), key=mx.random.key(a.prompt))
        for _, m in variants:
            run_once(m, prompt, 8)
        tg = {t: [] for t, _ in variants}
        toks = {}
        for r in range(a.reps):
            for t, m in variants[r % len(variants):] + variants[:r % len(variants)]:
                _, v, toks[t] = run_once(m, prompt, a.gen)
                tg[t].append(v)
            print(f"{name} rep {r}: " + " | ".join(f"{t} {v[-1]:.1f}" for t, v in tg.items()), flush=True)
        split = {t: host_split(m, prompt) for t, m in variants}
        same = {t: toks[t] == toks[variants[0][0]] for t in tg}
        res["decode"][name] = {t: {"tg": stats(tg[t]), "build_ms": split[t][0], "eval_ms": split[t][1],
                                   "same_tokens_as_default": same[t]} for t in tg}
        lines += [f"## {name} Q4, tg{a.gen} after {a.prompt} tokens ({a.reps} rotating repetitions)", "",
                  "| variant | tok/s median (min-max) | build ms | eval ms | tokens = default |",
                  "| --- | --- | --- | --- | --- |"]
        for t in tg:
            s = res["decode"][name][t]
            lines.append(f"| {t} | {s['tg']['median']:.1f} ({s['tg']['min']:.1f}-{s['tg']['max']:.1f}) | "
                         f"{s['build_ms']:.2f} | {s['eval_ms']:.2f} | {same[t]} |")
        lines.append("")
        if a.profile:
            lines += [f"### {name}: graph build of 48 decode steps, cProfile by own time", "", "```",
                      build_profile(variants[0][1], prompt).strip(), "```", ""]
        print("\n".join(lines[-6:]), flush=True)
        del variants
        mx.clear_cache()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
