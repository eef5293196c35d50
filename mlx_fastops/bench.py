"""Stock vs patched, in one process, alternating after warm-up (mlx-lm's timing definitions).

pp N: a random N-token prompt; prompt tok/s = N / time to the first generated token (prefill plus
      the first token's forward pass and sampling, as mlx_lm.generate reports it).
tg N: N tokens generated one by one after a 32-token prompt; tok/s = N / time after the first token.
Each trial runs stock and patched back to back, the order alternating between trials.
"""

import json
import platform
import statistics
import sys
import time

import mlx.core as mx
import mlx_lm
from mlx_lm.generate import generate_step

from . import __version__, patch, unpatch
from .config import backend_name
from .models import quant_label

TG_PROMPT = 32


def _run(model, prompt, max_tokens):
    """(seconds to first token, seconds for the remaining tokens, tokens) for one generation."""
    tokens = []
    t0 = time.perf_counter()
    t_first = None
    for (tok, _), _ in zip(generate_step(prompt, model, max_tokens=max_tokens), range(max_tokens)):
        tokens.append(tok)
        if t_first is None:
            t_first = time.perf_counter()
    t_end = time.perf_counter()
    return t_first - t0, t_end - t_first, tokens


def _measure(model, test, n_tokens, vocab, seed):
    prompt_len = n_tokens if test == "pp" else TG_PROMPT
    prompt = mx.random.randint(0, vocab, (prompt_len,), key=mx.random.key(seed))
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    if test == "pp":
        ttft, _, _ = _run(model, prompt, 1)
        tps = n_tokens / ttft
    else:
        _, rest, _ = _run(model, prompt, n_tokens + 1)
        tps = n_tokens / rest
    return tps, mx.get_peak_memory()


def greedy_tokens(model, prompt, n):
    return [t for (t, _), _ in zip(generate_step(prompt, model, max_tokens=n), range(n))]


def agreement(model, n=32, seed=1, disable=()):
    """Greedy tokens of stock and patched on one random prompt: (matching prefix, n, first diff)."""
    vocab = model.args.vocab_size
    prompt = mx.random.randint(0, vocab, (16,), key=mx.random.key(seed))
    unpatch(model)
    stock = greedy_tokens(model, prompt, n)
    patch(model, disable=disable)
    fused = greedy_tokens(model, prompt, n)
    same = next((i for i, (a, b) in enumerate(zip(stock, fused)) if a != b), n)
    return {"tokens": n, "matching": same, "identical": same == n, "stock": stock, "patched": fused}


def machine():
    dev = mx.default_device()
    info = {"platform": platform.platform(), "python": platform.python_version(),
            "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "mlx_fastops": __version__,
            "device": str(dev), "backend": backend_name()}
    try:
        info["device_info"] = {k: v for k, v in mx.device_info().items()
                               if isinstance(v, (int, float, str))}
    except Exception:  # older MLX: no device_info
        pass
    return info


def run(model, label, tests, trials=5, warmup=1, progress=True, seed=0, disable=()):
    """tests: list of ("pp"|"tg", n); disable: fusions left stock. Returns a result dict."""
    vocab = model.args.vocab_size
    report = patch(model, disable=disable)
    rows = []
    total = len(tests) * (warmup + trials) * 2
    done = 0
    for test, n in tests:
        samples = {"stock": [], "patched": []}
        peaks = {"stock": 0, "patched": 0}
        for trial in range(warmup + trials):
            order = ("stock", "patched") if trial % 2 == 0 else ("patched", "stock")
            for variant in order:
                if variant == "stock":
                    unpatch(model)
                else:
                    patch(model, disable=disable)
                tps, peak = _measure(model, test, n, vocab, seed + trial)
                done += 1
                if progress:
                    stage = "warm-up" if trial < warmup else f"trial {trial + 1 - warmup}/{trials}"
                    print(f"\r[bench] {test}{n} {stage} {variant:8s} "
                          f"{tps:10.2f} tok/s  ({done}/{total})", end="", file=sys.stderr, flush=True)
                if trial >= warmup:
                    samples[variant].append(tps)
                    peaks[variant] = max(peaks[variant], peak)
        rows.append({"test": f"{test}{n}", "stock": _stats(samples["stock"]),
                     "patched": _stats(samples["patched"]),
                     "ratio": statistics.median(samples["patched"]) / statistics.median(samples["stock"]),
                     "peak_memory_gb": {k: v / 1e9 for k, v in peaks.items()}})
    if progress:
        print("", file=sys.stderr)
    return {"model": label, "quant": quant_label(model), "machine": machine(), "trials": trials,
            "rows": rows, "agreement": agreement(model, disable=disable), "patch": report.to_dict()}


def _stats(xs):
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "samples": xs}


def to_markdown(result, note=""):
    m = result["machine"]
    lines = []
    if note:
        lines.append(f"Model note: {note}\n")
    lines += ["| model | quant | backend | test | stock t/s | patched t/s | ratio | peak mem stock / patched |",
              "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        s, p = r["stock"], r["patched"]
        mem = r["peak_memory_gb"]
        lines.append(
            f"| {result['model']} | {result['quant']} | {m['backend']} ({m['device']}) | {r['test']} | "
            f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f}) | {p['median']:.2f} ({p['min']:.2f}-{p['max']:.2f}) | "
            f"{r['ratio']:.3f} | {mem['stock']:.2f} / {mem['patched']:.2f} GB |")
    a = result["agreement"]
    lines.append("")
    lines.append(f"Greedy agreement: {a['matching']}/{a['tokens']} tokens identical"
                 + ("" if a["identical"] else f" (first difference at token {a['matching']})") + ".")
    lines.append(f"Median (min-max) of {result['trials']} trials, stock and patched alternating. "
                 f"mlx {m['mlx']}, mlx-lm {m['mlx_lm']}, mlx_fastops {m['mlx_fastops']}, "
                 f"{m['platform']}, Python {m['python']}.")
    return "\n".join(lines)


def plot(result, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit(f"--plot needs matplotlib (pip install 'mlx-fastops[plot]'): {e}")
    tests = [r["test"] for r in result["rows"]]
    x = range(len(tests))
    fig, ax = plt.subplots(figsize=(1.8 * len(tests) + 2, 3.5))
    for off, key in ((-0.2, "stock"), (0.2, "patched")):
        med = [r[key]["median"] for r in result["rows"]]
        err = [[m - r[key]["min"] for m, r in zip(med, result["rows"])],
               [r[key]["max"] - m for m, r in zip(med, result["rows"])]]
        ax.bar([i + off for i in x], med, width=0.4, yerr=err, label=key)
    ax.set_xticks(list(x), tests)
    ax.set_ylabel("tokens/s")
    ax.set_title(f"{result['model']} ({result['machine']['backend']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def save_json(result, path):
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
