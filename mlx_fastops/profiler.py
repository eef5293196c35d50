"""Per-op profile of decode steps or prefill chunks: every op evaluated on its own and timed.

Timing an op synchronously (inputs ready, run it, `mx.eval` its outputs) measures its launch,
host and device time together, as step 1 of the MNN write-up does. A unit (one decode step, one
prefill chunk) runs `warmup` times unrecorded, then `recorded` times; an op's time per unit is the
median over the recorded units. The unsynchronised unit time and the host time to build its graph
are measured on the same units beforehand and reported beside the table, so the op sum can be
compared with the real work.
"""

import importlib
import importlib.util
import json
import statistics
import time
from collections import Counter, defaultdict
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import cache as cache_mod, rope_utils
from mlx_lm.models.cache import make_prompt_cache

from . import modules as fused_modules
from .families import recipes
from .patcher import text_model

# Stock leaf modules timed at class level (their __call__ is looked up on the type): MLX's, and
# mlx-lm's RoPE variants (Llama-3 scaling, YaRN, ...: each calls mx.fast.rope itself).
_LEAF_CLASSES = (nn.Linear, nn.QuantizedLinear, nn.RMSNorm, nn.RoPE, nn.Embedding, nn.QuantizedEmbedding,
                 *(c for c in vars(rope_utils).values()
                   if isinstance(c, type) and issubclass(c, nn.Module) and c.__module__ == rope_utils.__name__))


class Profile:
    def __init__(self):
        self.times = defaultdict(list)  # op -> seconds per call, over everything recorded
        self.events = []  # (op, start, duration) for the trace
        self.units = []  # the events of each unit recorded through record()
        self.recording = False
        self.t0 = time.perf_counter()

    def timed(self, name, fn):
        return _Timed(self, name, fn)

    def record(self, run):
        """run() recorded as one unit (a decode step, a prefill chunk)."""
        first = len(self.events)
        self.recording = True
        try:
            run()
        finally:
            self.recording = False
        self.units.append(self.events[first:])


class _Timed:
    """Calls `fn`, timing it (outputs evaluated) while the profile records; other attributes are
    `fn`'s (callers read some, e.g. a fast path's `cache_types`). A call that returns None is a fast
    path declining (the composed ops run and are timed instead): not recorded."""

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
        if out is None:
            return out
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
                      "quantized": "quantized_attention", "out": "o_proj", "down": "down_proj",
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
    # The KV cache write: KVCache's, and that of each subclass with its own (the CUDA path's
    # StaticKVCache, which prefill writes through; none calls KVCache's, so none is timed twice).
    out += [(cls, "update_and_fetch", "kv_cache_update") for cls in _subclasses(cache_mod.KVCache)
            if "update_and_fetch" in vars(cls)]
    return out


def _subclasses(cls):
    return [cls] + [sub for c in cls.__subclasses__() for sub in _subclasses(c)]


def _importable(name):
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


def _random_tokens(model, n):
    return mx.random.randint(0, model.args.vocab_size, (1, n), key=mx.random.key(0))


def _measure(model, unit, recorded, warmup, setup=lambda: None):
    """Runs unit() (after setup(), untimed) warmup + recorded times unsynchronised, then as often
    again with every op timed on its own. unit() evaluates its work and returns the perf_counter
    time at which its graph was built. Returns the Profile and a result dict (without rows)."""
    wall, build = [], []
    for i in range(warmup + recorded):
        setup()
        t0 = time.perf_counter()
        built = unit()
        if i >= warmup:
            wall.append(time.perf_counter() - t0)
            build.append(built - t0)
    prof = Profile()
    with instrument(model, prof):
        for i in range(warmup + recorded):
            setup()
            if i >= warmup:
                prof.record(unit)
            else:
                unit()
    return prof, {"unit_ms": 1e3 * statistics.median(wall), "host_build_ms": 1e3 * statistics.median(build),
                  "recorded": recorded, "warmup": warmup, "events": prof.events}


def _rows(units):
    """Per op (in the order of first call): calls per unit, and the median over `units` (each a
    list of (op, start, seconds)) of its ms per unit (0 in a unit without it); the ops' sum, and each
    op's share of it."""
    per_unit = []
    for events in units:
        sums = defaultdict(float)
        for op, _, seconds in events:
            sums[op] += seconds
        per_unit.append(sums)
    calls = Counter(op for events in units for op, _, _ in events)
    rows = [{"op": op, "calls": n / len(units), "ms": 1e3 * statistics.median(s.get(op, 0.0) for s in per_unit)}
            for op, n in calls.items()]
    total = sum(r["ms"] for r in rows)
    for r in rows:
        r["share"] = r["ms"] / total if total else 0.0
    rows.sort(key=lambda r: -r["ms"])
    return {"rows": rows, "ops_ms": total}


def profile(model, context=32, recorded=16, warmup=4):
    """Decode steps after `context` random prompt tokens; returns a result dict (see to_markdown)."""
    if context < 1 or recorded < 1 or warmup < 0:
        raise ValueError(f"a decode profile needs context >= 1, recorded >= 1 and warmup >= 0; got {context}, "
                         f"{recorded}, {warmup}")
    cache = make_prompt_cache(model)
    logits = model(_random_tokens(model, context), cache=cache)
    tok = mx.argmax(logits[:, -1:], axis=-1)
    mx.eval(tok)

    def step():
        nonlocal tok
        logits = model(tok, cache=cache)
        built = time.perf_counter()
        tok = mx.argmax(logits[:, -1:], axis=-1)
        mx.eval(tok)
        return built

    prof, result = _measure(model, step, recorded, warmup)
    return {"unit": "step", **_rows(prof.units), **result}


def profile_prefill(model, chunk, context=0, recorded=5, warmup=2):
    """Prefill chunks of `chunk` random tokens, each into a fresh cache holding `context` tokens
    before it (prefilled untimed, in chunks of `chunk`, as mlx-lm's generate_step does). A chunk
    runs as mlx-lm prefills one: the decoder stack, then its KV cache evaluated; mlx-lm never
    evaluates a prefill chunk's logits, so the head does not run (the final norm is timed here,
    though mlx-lm leaves it unevaluated). Returns a result dict (see to_markdown)."""
    if chunk < 1 or context < 0 or recorded < 1 or warmup < 0:
        raise ValueError(f"a prefill profile needs chunk >= 1, context >= 0, recorded >= 1 and warmup >= 0; "
                         f"got {chunk}, {context}, {recorded}, {warmup}")
    text = text_model(model)
    if text is None:
        raise ValueError("a prefill profile needs an mlx-lm text model (a decoder stack at .model, or a "
                         "vision-language wrapper's language_model)")
    tokens = _random_tokens(model, context + chunk)
    cache = None

    def fill(part):
        text.model(part, cache=cache)
        built = time.perf_counter()
        mx.eval([c.state for c in cache])
        return built

    def fresh_cache():
        nonlocal cache
        cache = make_prompt_cache(model)
        for i in range(0, context, chunk):
            fill(tokens[:, i:min(i + chunk, context)])

    prof, result = _measure(model, lambda: fill(tokens[:, context:]), recorded, warmup, setup=fresh_cache)
    return {"unit": "chunk", "chunk": chunk, "context": context, **_rows(prof.units), **result}


def to_markdown(result):
    unit = result["unit"]
    lines = [f"| op | calls/{unit} | ms/{unit} (median) | share |", "|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['op']} | {r['calls']:.0f} | {r['ms']:.3f} | {100 * r['share']:.1f}% |")
    lines.append(f"| **total (ops evaluated one by one)** | | {result['ops_ms']:.3f} | 100% |")
    lines.append("")
    ms = result["unit_ms"]
    if unit == "step":
        what, waits = f"Decode step, unsynchronised: {ms:.3f} ms", ""
    else:
        before = f"after {result['context']} cached tokens" if result["context"] else "into a fresh cache"
        what = (f"Prefill chunk of {result['chunk']} tokens {before}, unsynchronised (as mlx-lm prefills: the KV "
                f"cache evaluated, no logits): {ms:.3f} ms = {1e3 * result['chunk'] / ms:.0f} tok/s")
        waits = " (with the waits of a path that paces its calls, as CUDA's prefill path does)"
    lines.append(f"{what} (median of {result['recorded']} {unit}s after {result['warmup']} warm-up; the ops one by "
                 f"one: {result['ops_ms'] / ms:.2f}x that); host time to build its graph: "
                 f"{result['host_build_ms']:.3f} ms{waits}.")
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
