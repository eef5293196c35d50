"""Kernel timeline of decode steps on MLX CUDA, stock vs patched (CUPTI through torch.profiler).

    python3 benchmarks/cuda_trace.py [--model qwen3-0.6b] [--prompt 512] [--steps 16] [--batch B] [--out DIR]

Runs mlx-lm's generate_step (greedy, pipelined), or with --batch B its BatchGenerator decoding B
sequences at once (as mlx_lm.server does), and records every GPU kernel of `--steps` decode steps
after 8 untimed ones with CUPTI (torch's profiler records all kernels of the process, MLX's
included). Prints, per variant: GPU-busy time per step (sum of kernel durations), wall time per
step (profiler on), kernels per step, and the most expensive kernels (count per step, mean and
total us per step). Writes DIR/cuda_trace_MODEL.md and .json.
"""

import argparse
import collections
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def kernels_of(prof):
    """[(name, start us, end us)] of the profile's GPU kernels, by start."""
    import torch

    out = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
           if e.device_type == torch.autograd.DeviceType.CUDA]
    return sorted(out, key=lambda r: r[1])


def decode_steps(model, prompt, n, batch):
    """An iterator of decode steps: generate_step's, or (batch) BatchGenerator's over `batch` rows,
    row i's prompt rotated by i."""
    if not batch:
        from mlx_lm.generate import generate_step

        yield from generate_step(prompt, model, max_tokens=n)
        return
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, max_tokens=n, completion_batch_size=batch, prefill_batch_size=batch)
    gen.insert([mx.roll(prompt, i).tolist() for i in range(batch)])
    while responses := gen.next_generated():
        yield responses
    gen.close()


def trace(model, prompt, steps, batch, warm=8):
    import torch
    from torch.profiler import ProfilerActivity, profile

    gen = decode_steps(model, prompt, warm + steps + 4, batch)
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
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--batch", type=int, default=0, help="rows decoded together through BatchGenerator")
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--out", default="benchmarks/results")
    a = ap.parse_args()
    import mlx.core as mx

    if not mx.cuda.is_available():
        sys.exit("cuda_trace: MLX's CUDA backend is not available here")
    import torch

    import mlx_fastops
    from mlx_fastops import bench, synthetic_model

    torch.cuda.init()
    os.environ.setdefault("MLX_FASTOPS_BACKEND", "cuda")
    model = synthetic_model(a.model, bits=4)
    prompt = mx.random.randint(0, model.args.vocab_size, (a.prompt,), key=mx.random.key(1))
    m = bench.machine()
    texts = [f"# Decode kernel timeline: {a.model}, 4-bit\n\n{m.get('gpu') or m['device']}; mlx {m['mlx']}; "
             f"commit {m['commit']} (sources {m['sources']}); {a.steps} steps after 8 untimed ones.\n"]
    js = []
    for label in ("stock", "patched"):
        if label == "patched":
            mlx_fastops.patch(model, tune="off")   # every kernel, untuned
        prof, wall = trace(model, prompt, a.steps, a.batch)
        rows = f", {a.batch} rows through BatchGenerator" if a.batch else ""
        t, j = summarise(f"{a.model} {label}, decode after {a.prompt}{rows}", prof, wall, a.steps, a.top)
        print(t, flush=True)
        texts.append(t)
        js.append(j)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    stem = f"cuda_trace_{a.model}" + (f"_b{a.batch}" if a.batch else "")
    Path(a.out, f"{stem}.md").write_text("\n".join(texts))
    Path(a.out, f"{stem}.json").write_text(json.dumps({"machine": m, "variants": js}, indent=1))


if __name__ == "__main__":
    main()
