"""Kernel timeline of decode steps on MLX CUDA, stock vs patched (CUPTI through torch.profiler).

    python3 benchmarks/cuda_trace.py [--model qwen3-0.6b] [--steps 16] [--out DIR]

Runs mlx-lm's generate_step (greedy, pipelined) and records every GPU kernel of `--steps` decode
steps with CUPTI (torch's profiler records all kernels of the process, MLX's included). Prints, per
variant: GPU-busy time per step (sum of kernel durations), wall time per step, kernels per step, and
the most expensive kernels (count per step, mean and total us per step). Writes the tables (and the
Chrome traces) to --out.
"""

import argparse
import collections
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: F401  (CUPTI through kineto)
from torch.profiler import ProfilerActivity, profile

import mlx.core as mx
from mlx_lm.generate import generate_step

import mlx_fastops
from mlx_fastops import synthetic_model


def kernels_of(prof):
    out = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out.append((e.name, e.time_range.start, e.time_range.end))
    return sorted(out, key=lambda r: r[1])


def trace(model, prompt, steps, warm=8):
    gen = generate_step(prompt, model, max_tokens=warm + steps + 4)
    for _ in range(warm):
        next(gen)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            next(gen)
        t1 = time.perf_counter()
    for _ in gen:
        pass
    return prof, (t1 - t0) / steps * 1e6


def summarise(label, prof, wall_us, steps, top):
    ks = kernels_of(prof)
    busy = sum(e - s for _, s, e in ks)
    span = (ks[-1][2] - ks[0][1]) if ks else 0
    by = collections.defaultdict(list)
    for n, s, e in ks:
        by[n[:60]].append(e - s)
    rows = sorted(by.items(), key=lambda kv: -sum(kv[1]))[:top]
    lines = [f"## {label}", "",
             f"wall {wall_us:.0f} us/step; kernels {len(ks) / steps:.0f}/step; GPU busy {busy / steps:.0f} us/step; "
             f"first-to-last kernel span {span / steps:.0f} us/step", "",
             "| kernel | per step | mean us | us/step |", "| --- | --- | --- | --- |"]
    for n, ds in rows:
        lines.append(f"| {n} | {len(ds) / steps:.1f} | {sum(ds) / len(ds):.2f} | {sum(ds) / steps:.1f} |")
    return "\n".join(lines) + "\n", {"label": label, "wall_us": wall_us, "kernels_per_step": len(ks) / steps,
                                     "busy_us": busy / steps, "span_us": span / steps,
                                     "top": [(n, len(ds) / steps, sum(ds) / len(ds)) for n, ds in rows]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    a = ap.parse_args()
    torch.cuda.init()
    os.environ.setdefault("MLX_FASTOPS_BACKEND", "cuda")
    model = synthetic_model(a.model, bits=4)
    prompt = mx.random.randint(0, model.args.vocab_size, (a.prompt,), key=mx.random.key(1))
    texts, js = [], []
    for label in ("stock", "patched"):
        if label == "patched":
            mlx_fastops.patch(model)
        prof, wall = trace(model, prompt, a.steps)
        t, j = summarise(f"{a.model} {label}, decode after {a.prompt}", prof, wall, a.steps, a.top)
        print(t, flush=True)
        texts.append(t)
        js.append(j)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    Path(a.out, f"trace_{a.model}.md").write_text("\n".join(texts))
    Path(a.out, f"trace_{a.model}.json").write_text(json.dumps(js, indent=1))


if __name__ == "__main__":
    main()
