"""Per-op decode profile: every op of a decode step evaluated on its own and timed.

Timing an op synchronously (inputs ready, run it, `mx.eval` its outputs) measures its launch,
host and device time together, as step 1 of the MNN write-up does. The first `warmup` tokens are
not recorded. The unsynchronised step time and the host time to build one step's graph are
reported beside the table, so the op sum can be compared with the real step.
"""

import importlib
import importlib.util
import json
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import cache as cache_mod
from mlx_lm.models.cache import make_prompt_cache

from . import modules as fused_modules
from .families import recipes

# Stock leaf modules timed at class level (their __call__ is looked up on the type).
_LEAF_CLASSES = (nn.Linear, nn.QuantizedLinear, nn.RMSNorm, nn.RoPE, nn.Embedding,
                 nn.QuantizedEmbedding)


class Profile:
    def __init__(self):
        self.times = defaultdict(list)  # op -> seconds per call, over recorded steps
        self.events = []  # (op, start, duration) for the trace
        self.recording = False
        self.t0 = time.perf_counter()

    def timed(self, name, fn):
        return _Timed(self, name, fn)


class _Timed:
    """Calls `fn`, timing it (outputs evaluated) while the profile records; other attributes are
    `fn`'s (callers read some, e.g. a fast path's `cache_type`)."""

    def __init__(self, prof, name, fn):
        self._prof, self._name, self._fn = prof, name, fn

    def __getattr__(self, attr):
        return getattr(self._fn, attr)

    def __call__(self, *args, **kwargs):
        prof = self._prof
        if not prof.recording:
            return self._fn(*args, **kwargs)
        start = time.perf_counter()
        out = self._fn(*args, **kwargs)
        mx.eval(out)
        end = time.perf_counter()
        prof.times[self._name].append(end - start)
        prof.events.append((self._name, start - prof.t0, end - start))
        return out


def _leaf_name(module_names, obj, fallback):
    return module_names.get(id(obj), fallback)


@contextmanager
def instrument(model, prof):
    """Wrap the model's ops with timers for the duration of the block, then restore everything."""
    restore = []
    names = {}
    for path, mod in model.named_modules():
        names[id(mod)] = path.split(".")[-1] or type(mod).__name__
        for attr, value in list(vars(mod).items()):
            if attr.endswith("_fn") and callable(value):
                op = attr[: -len("_fn")]
                op = {"add_norm": "rms_norm_residual", "norm_rope": "qk_norm_rope",
                      "qkv": "qkv_proj", "gate_up": "gate_up_silu", "_fastops_head": "lm_head",
                      "decode": "decode_attention", "prefill": "flash_attention",
                      "quantized": "quantized_attention", "out": "linear", "down": "linear",
                      "fast": "decoder_block (fast path)"}.get(op, op)
                object.__setattr__(mod, attr, prof.timed(op, value))
                restore.append((mod, attr, value))
    for cls in _LEAF_CLASSES:
        for meth in ("__call__", "as_linear"):
            if meth in vars(cls):
                orig = vars(cls)[meth]

                def make(orig=orig, meth=meth):
                    def call(self, *a, **k):
                        name = _leaf_name(names, self, type(self).__name__)
                        if meth == "as_linear":
                            name = "lm_head"
                        return prof.timed(name, lambda *a2, **k2: orig(self, *a2, **k2))(*a, **k)
                    return call

                setattr(cls, meth, make())
                restore.append((cls, meth, orig))
    # Attention cores and cache writes are functions/methods, not modules.
    for mod, attr, name in _function_targets():
        orig = getattr(mod, attr)
        timed = prof.timed(name, orig)
        # A plain function, so that a method (KVCache.update_and_fetch) still binds `self`.
        setattr(mod, attr, lambda *a, _timed=timed, **k: _timed(*a, **k))
        restore.append((mod, attr, orig))
    try:
        yield prof
    finally:
        for owner, attr, value in reversed(restore):
            if isinstance(owner, type) or not isinstance(owner, nn.Module):
                setattr(owner, attr, value)
            else:
                object.__setattr__(owner, attr, value)


def _function_targets():
    """(owner, attribute, op name) of the functions to time: the stock attention core and SwiGLU
    as each family's module (see mlx_fastops.families) calls them, and the KV cache write."""
    out = [(fused_modules, "stock_sdpa", "sdpa")]
    for recipe in recipes().values():
        for name in recipe["modules"]:
            if not _importable(name):
                continue  # an alias into a package that is not installed, or a module this mlx-lm lacks
            m = importlib.import_module(name)
            if hasattr(m, "scaled_dot_product_attention"):
                out.append((m, "scaled_dot_product_attention", "sdpa"))
            if hasattr(m, "swiglu"):
                out.append((m, "swiglu", "swiglu"))
    out.append((cache_mod.KVCache, "update_and_fetch", "kv_cache_update"))
    return out


def _importable(name):
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


def profile(model, prompt_len=32, tokens=16, warmup=4):
    """Decode `tokens` steps after `prompt_len` random prompt tokens; returns a result dict."""
    if prompt_len < 1 or tokens < 1 or warmup < 0:
        raise ValueError(f"profile needs prompt_len >= 1, tokens >= 1 and warmup >= 0; got {prompt_len}, "
                         f"{tokens}, {warmup}")
    vocab = model.args.vocab_size
    prompt = mx.random.randint(0, vocab, (1, prompt_len), key=mx.random.key(0))
    cache = make_prompt_cache(model)
    logits = model(prompt, cache=cache)
    tok = mx.argmax(logits[:, -1:], axis=-1)
    mx.eval(tok)
    # Unsynchronised reference: step wall time and host graph-building time.
    build, wall = [], []
    for i in range(warmup + tokens):
        t0 = time.perf_counter()
        logits = model(tok, cache=cache)
        t1 = time.perf_counter()
        tok = mx.argmax(logits[:, -1:], axis=-1)
        mx.eval(tok)
        t2 = time.perf_counter()
        if i >= warmup:
            build.append(t1 - t0)
            wall.append(t2 - t0)
    prof = Profile()
    with instrument(model, prof):
        for i in range(warmup + tokens):
            prof.recording = i >= warmup
            logits = model(tok, cache=cache)
            tok = mx.argmax(logits[:, -1:], axis=-1)
            mx.eval(tok)
    rows = []
    total = sum(sum(v) for v in prof.times.values()) / tokens
    for name, ts in prof.times.items():
        per_step = sum(ts) / tokens
        rows.append({"op": name, "calls_per_step": len(ts) / tokens, "ms_per_step": per_step * 1e3,
                     "share": per_step / total if total else 0.0})
    rows.sort(key=lambda r: -r["ms_per_step"])
    return {"rows": rows, "ops_ms_per_step": total * 1e3,
            "step_ms": 1e3 * sorted(wall)[len(wall) // 2],
            "host_build_ms": 1e3 * sorted(build)[len(build) // 2],
            "tokens": tokens, "warmup": warmup, "events": prof.events}


def to_markdown(result):
    lines = ["| op | calls/step | ms/step | share |", "|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['op']} | {r['calls_per_step']:.0f} | {r['ms_per_step']:.3f} | "
                     f"{100 * r['share']:.1f}% |")
    lines.append(f"| **total (ops evaluated one by one)** | | {result['ops_ms_per_step']:.3f} | 100% |")
    lines.append("")
    lines.append(f"Decode step, unsynchronised: {result['step_ms']:.3f} ms (median of {result['tokens']} "
                 f"tokens after {result['warmup']} warm-up); host time to build its graph: "
                 f"{result['host_build_ms']:.3f} ms.")
    return "\n".join(lines)


def write_trace(result, path):
    """Chrome / Perfetto trace (chrome://tracing, ui.perfetto.dev)."""
    events = [{"name": n, "ph": "X", "ts": s * 1e6, "dur": d * 1e6, "pid": 0, "tid": 0}
              for n, s, d in result["events"]]
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


def capture_problem(path):
    """Why a Metal GPU capture into `path` cannot be made here, or None."""
    if not mx.metal.is_available():
        return ("--capture records a Metal GPU trace (mx.metal.start_capture); this machine has no Metal "
                f"device (MLX default device: {mx.default_device()}). On CUDA use Nsight Systems: "
                "nsys profile mlx-fastops profile ...")
    if Path(path).suffix != ".gputrace":
        return f"--capture writes an Xcode GPU trace, whose name ends in .gputrace; got {Path(path).name}"
    return None


def capture(model, path, tokens=4):
    """Metal GPU capture of a few decode steps (Xcode .gputrace). Raises RuntimeError elsewhere."""
    if problem := capture_problem(path):
        raise RuntimeError(problem)
    cache = make_prompt_cache(model)
    tok = mx.array([[1]])
    mx.eval(model(tok, cache=cache))
    mx.metal.start_capture(str(path))
    try:
        for _ in range(tokens):
            mx.eval(model(tok, cache=cache))
    finally:
        mx.metal.stop_capture()
