"""Stock vs patched mlx-lm on MLX's CUDA backend: prefill and decode, in turn in one process.

    python3 benchmarks/cuda_bench.py [--models qwen3-0.6b,qwen3-4b,qwen3-8b,llama-3.2-1b]
        [--bits 4] [--reps 3] [--prompts 512,2048] [--gen 128] [--out benchmarks/results/cuda_bench]
        [--disable NAMES ...] [--loaded]

Copies of each synthetic model (same seed, so the same weights) are built: one stays stock, one
is patched (MLX_FASTOPS_BACKEND=cuda, the defaults), and per --disable NAMES (repeatable) one more
is patched with those fusions off (e.g. --disable layer_kernel: 5 launches per layer; --disable
layer_groups). With --loaded, two more (stock and patched) are written to a local mlx-lm model
directory and read back with mlx_lm.load, as a user's checkpoint is: MLX's CUDA backend puts arrays
that the CPU makes (mx.load's) in managed memory and arrays that GPU kernels make in device memory.
Each repetition runs every variant (the order rotates between repetitions) through
mlx_lm.generate.generate_step, mlx-lm's own decode loop (greedy, async_eval pipelining): prompt tok/s = prompt tokens / time to the first token (mlx-lm's
definition), decode tok/s = (gen - 1) / time from the first to the last token. Reports median and
spread (min-max), the ratio, greedy agreement of the two runs, and a host/GPU split of one decode
step: Python graph-building time (model call, no evaluation) vs time to evaluate it.
"""

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx
import mlx_lm
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

import mlx_fastops
from mlx_fastops import save_synthetic, synthetic_model


def source_digest():
    """sha1 (12 hex) of the package and kernel sources: names the code that ran, whatever git says."""
    import hashlib
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha1()
    for f in sorted([*root.glob("mlx_fastops/**/*.py"), *root.glob("patches/*.json"), *root.glob("cuda/*.cu")]):
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:12]


def device_name():
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception:
        return str(mx.default_device())


def run_once(model, prompt, gen):
    """(prompt tok/s, decode tok/s, tokens). Python's garbage collector is paused while timing (for
    every variant alike): a collection costs milliseconds, a decode step a few hundred us."""
    toks = []
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        t_first = None
        for i, (tok, _) in enumerate(generate_step(prompt, model, max_tokens=gen)):
            if i == 0:
                t_first = time.perf_counter()
            toks.append(int(tok))
        t_end = time.perf_counter()
    finally:
        gc.enable()
    return len(prompt) / (t_first - t0), (gen - 1) / (t_end - t_first), toks


def host_split(model, prompt, steps=24, profile=None):
    """Per decode step: Python graph build time and evaluation time (unpipelined), in ms. With
    `profile` (a cProfile.Profile), each build runs under it (its times then include the profiler's)."""
    cache = make_prompt_cache(model)
    logits = model(prompt[None], cache=cache)
    y = mx.argmax(logits[:, -1, :], axis=-1)
    mx.eval(y)
    builds, evals = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        if profile:
            profile.enable()
        logits = model(y[:, None], cache=cache)
        y = mx.argmax(logits[:, -1, :], axis=-1)
        if profile:
            profile.disable()
        t1 = time.perf_counter()
        mx.eval(y)
        t2 = time.perf_counter()
        builds.append((t1 - t0) * 1e3)
        evals.append((t2 - t1) * 1e3)
    k = steps // 4
    return statistics.median(builds[k:]), statistics.median(evals[k:])


def stats(xs):
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": xs}


def build_variants(name, bits, disables=(), loaded_dir=None):
    """[(tag, model)]: stock, patched, per entry of `disables` (comma-separated fusion names) one
    patched with those off, tagged "without NAMES", and with loaded_dir "stock, loaded" and
    "patched, loaded": the model saved there and read back by mlx_lm.load. Same seed: same weights."""
    variants = [("stock", synthetic_model(name, bits=bits)), ("patched", synthetic_model(name, bits=bits))]
    reports = {"patched": mlx_fastops.patch(variants[1][1])}
    for names in disables:
        m = synthetic_model(name, bits=bits)
        tag = f"without {names}"
        reports[tag] = mlx_fastops.patch(m, disable=names)
        variants.append((tag, m))
    if loaded_dir is not None:
        path = save_synthetic(name, Path(loaded_dir) / name, bits=bits)
        variants.append(("stock, loaded", mlx_lm.load(str(path))[0]))
        m = mlx_lm.load(str(path))[0]
        reports["patched, loaded"] = mlx_fastops.patch(m)
        variants.append(("patched, loaded", m))
    return variants, reports


def bench_model(name, bits, reps, prompts, gen, log, disables=(), loaded_dir=None):
    os.environ["MLX_FASTOPS_BACKEND"] = "cuda"
    t0 = time.perf_counter()
    variants, reports = build_variants(name, bits, disables, loaded_dir)
    log(f"{name}: models built and patched in {time.perf_counter() - t0:.1f}s")
    log(str(reports["patched"]))
    tags = [t for t, _ in variants]
    vocab = variants[0][1].args.vocab_size
    out = {"model": name, "bits": bits, "group_size": 64, "variants": tags,
           "patch": reports["patched"].to_dict(), "prompts": {}}
    for p in prompts:
        prompt = mx.random.randint(0, vocab, (p,), key=mx.random.key(p))
        for _, m in variants:   # warm-up (kernel compiles, compile traces, cache growth)
            run_once(m, prompt, 8)
        res = {t: {"pp": [], "tg": []} for t in tags}
        agree = {t: [] for t in tags[1:]}
        for r in range(reps):
            order = variants[r % len(variants):] + variants[:r % len(variants)]   # rotate: each goes first
            toks = {}
            for tag, m in order:
                pp, tg, tk = run_once(m, prompt, gen)
                res[tag]["pp"].append(pp)
                res[tag]["tg"].append(tg)
                toks[tag] = tk
            for t in tags[1:]:
                agree[t].append(next((i for i, (a, b) in enumerate(zip(toks["stock"], toks[t])) if a != b), gen))
            log(f"  {name} p={p} rep {r}: " + " | ".join(
                f"{t} pp {res[t]['pp'][-1]:.0f} tg {res[t]['tg'][-1]:.1f}" for t in tags)
                + f" | agree {[agree[t][-1] for t in tags[1:]]}/{gen}")
        entry = {t: {k: stats(v) for k, v in res[t].items()} for t in tags}
        entry["agree_first_tokens"] = agree["patched"]
        entry["agree_first_tokens_by_variant"] = agree
        entry["host_split_ms"] = {}
        for t, m in variants:
            b, e = host_split(m, prompt)
            entry["host_split_ms"][t] = {"build": b, "eval": e}
        log("  host split ms/step: " + " | ".join(
            f"{t} build {v['build']:.2f} eval {v['eval']:.2f}" for t, v in entry["host_split_ms"].items()))
        out["prompts"][str(p)] = entry
    del variants
    mx.clear_cache()
    return out


def markdown(results, meta):
    tags = results[0]["variants"] if results else ["stock", "patched"]
    cols = "".join(f" {t} tok/s | ratio |" for t in tags[1:])
    lines = [f"# CUDA benchmark: stock mlx-lm vs mlx_fastops (patched)", "",
             f"device: {meta['device']}; mlx {meta['mlx']}, mlx-lm {meta['mlx_lm']}; commit {meta['commit']} "
             f"(sources {meta.get('source', '?')}); "
             f"{meta['reps']} rotating repetitions, median (min-max)"
             + (f"; MLX_FASTOPS_DISABLE={meta['MLX_FASTOPS_DISABLE']}" if meta.get("MLX_FASTOPS_DISABLE") else "")
             + ".", "",
             f"| model | test | stock tok/s |{cols} greedy agreement with stock (first diff / gen) |",
             "| --- | --- | --- |" + " --- | --- |" * (len(tags) - 1) + " --- |"]
    fmt = lambda s: f"{s['median']:.0f} ({s['min']:.0f}-{s['max']:.0f})"
    for res in results:
        for p, e in res["prompts"].items():
            agree = e.get("agree_first_tokens_by_variant", {"patched": e["agree_first_tokens"]})
            for kind, label in (("pp", f"pp{p}"), ("tg", f"tg{meta['gen']} @ {p}")):
                s = e["stock"][kind]
                cells = "".join(f" {fmt(e[t][kind])} | {e[t][kind]['median'] / s['median']:.2f}x |" for t in tags[1:])
                ag = ", ".join(f"{min(agree[t])}/{meta['gen']}" for t in tags[1:])
                lines.append(f"| {res['model']} Q{res['bits']} | {label} | {fmt(s)} |{cells} {ag} |")
    lines += ["", "Host/GPU split of one decode step (ms, unpipelined: Python graph build, then mx.eval):", "",
              "| model | prompt |" + "".join(f" {t} build | {t} eval |" for t in tags),
              "| --- | --- |" + " --- | --- |" * len(tags)]
    for res in results:
        for p, e in res["prompts"].items():
            h = e["host_split_ms"]
            lines.append(f"| {res['model']} | {p} |" + "".join(f" {h[t]['build']:.2f} | {h[t]['eval']:.2f} |" for t in tags))
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="qwen3-0.6b,qwen3-4b,qwen3-8b,llama-3.2-1b")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompts", default="512,2048")
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--out", default="benchmarks/results/cuda_bench")
    ap.add_argument("--disable", action="append", default=[], metavar="NAMES",
                    help="add a variant patched with these fusions off (comma-separated names of "
                         "mlx_fastops.FUSIONS); may be given more than once")
    ap.add_argument("--loaded", action="store_true",
                    help="add stock and patched read back by mlx_lm.load from a saved copy of the model")
    a = ap.parse_args()
    if not mx.cuda.is_available():
        sys.exit("cuda_bench: MLX's CUDA backend is not available here")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    if subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                      text=True).stdout.strip():
        commit += "+uncommitted"   # the device gets a working tree whose HEAD may be older
    meta = {"device": device_name(), "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__,
            "python": platform.python_version(), "commit": commit or "?", "source": source_digest(),
            "reps": a.reps, "gen": a.gen, "MLX_FASTOPS_DISABLE": os.environ.get("MLX_FASTOPS_DISABLE", ""),
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    log = lambda s: print(s, flush=True)
    log(json.dumps(meta))
    results = []
    loaded_dir = tempfile.TemporaryDirectory() if a.loaded else None
    for name in a.models.split(","):
        results.append(bench_model(name, a.bits, a.reps, [int(p) for p in a.prompts.split(",")], a.gen, log,
                                   a.disable, loaded_dir and loaded_dir.name))
        out = Path(a.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
        out.with_suffix(".md").write_text(markdown(results, meta))
    print(markdown(results, meta))


if __name__ == "__main__":
    main()
