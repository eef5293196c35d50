"""Measure each fusion on the device at hand, keep only what wins: patch(model, tune=...).

Stock MLX's kernels are well tuned, and ours were measured on one GPU (an H200) only: on another
device a fusion may lose. The tuner patches the model with every fusion on, times each fusion's
op against the stock ops it replaces on the model's own shapes (tune_probes: decode rows 1..B,
prefill chunks), and turns off the ones that do not win. A GPU's prefill path (`prefill`) is judged
by whole prompt chunks of the model patched with and without it, and a backend's whole-step
switches (fast_decode, compile: CUDA's decode path) by whole decode steps.

Timing: per shape, both sides are warmed up (kernel builds), then timed `samples` times each,
interleaved (fused, stock, stock, fused, ...); a sample evaluates `reps` calls on distinct inputs
(reps chosen so that a sample takes about TARGET_S: a single small op is shorter than the
launch-and-sync noise). The timing source is `timer(fusion, variant, run) -> seconds` (run() does
the work once): the wall clock by default, a test double in the tests.

Decision, noise-aware: at a shape a fusion wins where the upper quartile of its times is below the
lower quartile of stock's, loses where its lower quartile is above stock's upper quartile, else
ties (the quartiles, not min/max: one preempted sample must not decide). A fusion is kept only if
it wins at some shape and loses at none; a tie is not a win (stock then runs: never slower). The
reported ratio is stock's median time / the fusion's (> 1: the fusion is faster), the worst shape's.
`prefill` is decided per chunk size (_judge_prefill): stock between the sizes it does not win at.
On a backend with a decode path, its parts (DecodePath.parts) stay on wherever fast_decode is kept.

When (config.TUNE_MODES): "auto" (the default) measures on a GPU backend whose kernel factory is
MLX's own (never on emulated kernels: kernels.factory_replaced) and nowhere else (on the
reference path every fusion composes stock's own ops); "on" anywhere; "force" measures again
even where a decision is cached; "off" never. Decisions are cached (tune_cache) per device, MLX
and mlx_fastops version, backend, user-disabled fusions, tuning shapes and model shape class.
"""

import hashlib
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from . import config, kernels, ops, tune_cache
from .tune_probes import probes

TARGET_S = 0.004   # one sample's wall time, at least (a few GPU launches and a sync are ~0.1 ms)
MAX_REPS = 32


def wall_clock(fusion, variant, run):
    mx.synchronize()
    t0 = time.perf_counter()
    run()
    mx.synchronize()
    return time.perf_counter() - t0


class Tuner:
    """patch(model, tune=Tuner(...)): when to tune (mode), on which shapes, with which clock.
    rows: decode batch sizes; prefill: prompt chunk lengths; context: the KV length of decode
    attention and the prompt before timed decode steps; samples: timed samples per side and shape;
    steps: decode steps (and prompt chunks, per size) timed per variant and round of the
    whole-path switches (rounds of them)."""

    def __init__(self, mode="on", rows=(1, 4), prefill=None, context=512, samples=15, steps=8, rounds=3,
                 timer=wall_clock, quiet=False):
        self.mode = config.tune_mode(mode)
        if prefill is None:   # where a GPU makes it cheap: 64 rows (CUDA's tensor-core qmm, 9-64 rows:
            # the size of a batched decode step, judged before 1024 and 2048, the dense path's chunks
            # up to mlx-lm's prefill chunk; a loss at 64 keeps stock up to 64 rows)
            prefill = (64, 1024, 2048) if mx.metal.is_available() or mx.cuda.is_available() else (512,)
        if not rows or not prefill or min(*rows, *prefill, context) < 1 or samples < 4 or steps < 2 or rounds < 1:
            raise ValueError(f"Tuner needs rows, prefill and context >= 1, samples >= 4, steps >= 2, rounds >= 1; "
                             f"got rows={rows}, prefill={prefill}, context={context}, samples={samples}, "
                             f"steps={steps}, rounds={rounds}")
        self.rows, self.prefill, self.context = tuple(rows), tuple(prefill), context
        self.samples, self.steps, self.rounds = samples, steps, rounds
        self.timer, self.quiet = timer, quiet

    def shapes(self):
        return {"rows": list(self.rows), "prefill": list(self.prefill), "context": self.context}

    def measures(self, backend):
        """Whether this patch measures (or reads the cache) at all."""
        if self.mode == "off":
            return False
        if self.mode == "auto":
            return backend != "reference" and not kernels.factory_replaced(backend)
        return True


@dataclass
class Shape:
    shape: str
    fused_s: list
    stock_s: list

    @property
    def ratio(self):
        return statistics.median(self.stock_s) / statistics.median(self.fused_s)

    @property
    def verdict(self):
        f_lo, _, f_hi = statistics.quantiles(self.fused_s, n=4, method="inclusive")
        s_lo, _, s_hi = statistics.quantiles(self.stock_s, n=4, method="inclusive")
        return "win" if f_hi < s_lo else "loss" if f_lo > s_hi else "tie"


@dataclass
class Decision:
    fusion: str
    kept: bool
    note: str
    shapes: list = field(default_factory=list)
    above: int = None   # prefill only: the backend's path runs for more rows than this (stock_rows)
    upto: int = None    # prefill only, with above: and for up to this many rows

    @property
    def ratio(self):
        return min((s.ratio for s in self.shapes), default=None)


def _judge(fusion, shapes):
    verdicts = [s.verdict for s in shapes]
    losses = [f"{s.shape} {s.ratio:.2f}x" for s, v in zip(shapes, verdicts) if v == "loss"]
    if losses:
        return Decision(fusion, False, "slower than stock at " + ", ".join(losses), shapes)
    if "win" not in verdicts:
        return Decision(fusion, False, "no shape faster than stock beyond the spread", shapes)
    ties = [s.shape for s, v in zip(shapes, verdicts) if v == "tie"]
    return Decision(fusion, True, "faster" + (f" (ties at {', '.join(ties)})" if ties else ""), shapes)


def _judge_prefill(sized):
    """`prefill` from [(rows, Shape)], a whole prompt chunk per size: kept above the largest size
    where it does not win, if it wins at the largest size (there, what the trend of GEMMs, more
    rows and more reuse of each dequantised weight, makes likely above it as well); and up to the
    sizes below the first it does not win at (a GPU's path is several kernels by row count: CUDA's
    tensor-core qmm up to 64 rows, dense matmuls from 512; a loss of one must not drop the other)."""
    sized = sorted(sized, key=lambda ns: ns[0])
    sizes, shapes = [n for n, _ in sized], [s for _, s in sized]
    won = {n: s.verdict == "win" for n, s in sized}
    if not won[sizes[-1]]:
        d = _judge("prefill", shapes[-1:])
        return Decision("prefill", False, d.note + f" at {sizes[-1]} rows", shapes)
    short = [n for n in sizes if not won[n]]
    if not short:
        return Decision("prefill", True, "faster", shapes)
    lead = [n for n in sizes if n < short[0]]
    upto = max(lead) if lead else None
    where = f"up to {upto} and above {max(short)} rows; stock between" if upto else \
        f"above {max(short)} rows; stock up to them"
    return Decision("prefill", True, f"faster {where}", shapes, max(short), upto)


def stock_rows(decision):
    """(lo, hi): the rows lo < rows <= hi that a kept `prefill` decision leaves to stock, or None."""
    if decision is None or not decision.kept or decision.above is None:
        return None
    return (decision.upto or 0, decision.above)


def same_plan(a, b):
    """Whether two tunings (or None) patch the same way (a parked fused state can be resumed)."""
    plan = lambda t: (t.reasons(), stock_rows(t.decisions.get("prefill"))) if t else ({}, None)
    return plan(a) == plan(b)


@dataclass
class Tuning:
    """The tuner's decisions for one patch: {fusion: Decision}, where they came from ("measured"
    or "cache"), the device, and the seconds the measuring took."""
    device: str
    source: str
    seconds: float
    decisions: dict

    @property
    def off(self):
        return {f for f, d in self.decisions.items() if not d.kept}

    def reasons(self):
        """{fusion turned off: the patch report's reason}."""
        return {f: f"tuned off: {d.note}" for f, d in self.decisions.items() if not d.kept}

    def rows(self):
        """(fusion, kept, worst-shape ratio, per-shape ratios, note), in FUSIONS order."""
        return [(f, d.kept, d.ratio, ", ".join(f"{s.shape} {s.ratio:.2f}x" for s in d.shapes), d.note)
                for f, d in sorted(self.decisions.items(), key=lambda kv: list(config.FUSIONS).index(kv[0]))]

    def table(self):
        lines = [f"tuned on {self.device} ({self.source}" + (f", {self.seconds:.1f} s" if self.source == "measured"
                                                              else "") + "); ratio: stock time / fused time",
                 "| fusion | tuned | ratio (worst shape) | per shape | note |", "|---|---|---|---|---|"]
        for f, kept, ratio, shapes, note in self.rows():
            worst = f"{ratio:.2f}x" if ratio is not None else "-"
            lines.append(f"| {f} | {'kept' if kept else 'off'} | {worst} | {shapes or '-'} | {note} |")
        return "\n".join(lines)

    def to_dict(self):
        return {"device": self.device, "source": self.source, "seconds": self.seconds,
                "decisions": [{**asdict(d), "ratio": d.ratio} for d in self.decisions.values()]}

    @classmethod
    def from_dict(cls, doc, source="cache"):
        """Raises ValueError / KeyError / TypeError where `doc` is not a valid tuning."""
        decisions = {}
        for d in doc["decisions"]:
            if d["fusion"] not in config.FUSIONS or not isinstance(d["kept"], bool) or not isinstance(d["note"], str):
                raise ValueError(f"bad decision {d!r}")
            shapes = [Shape(str(s["shape"]), [float(t) for t in s["fused_s"]], [float(t) for t in s["stock_s"]])
                      for s in d["shapes"]]
            if any(len(s.fused_s) < 2 or len(s.stock_s) < 2 or min(*s.fused_s, *s.stock_s) <= 0 for s in shapes):
                raise ValueError(f"bad timings for {d['fusion']}")
            above, upto = d.get("above"), d.get("upto")
            if any(n is not None and (type(n) is not int or n < 1) for n in (above, upto)) or (
                    upto is not None and (above is None or upto >= above)):
                raise ValueError(f"bad prefill rows {above!r}, {upto!r}")
            decisions[d["fusion"]] = Decision(d["fusion"], d["kept"], d["note"], shapes, above, upto)
        return cls(str(doc["device"]), source, float(doc["seconds"]), decisions)


def shape_class(text):
    """The model's shape class: its type, depth, and every parameter's name, shape and dtype in the
    first decoder block, the embedding and the head (sha1, 16 hex, and a readable summary)."""
    layers = text.model.layers
    parts = [("block", layers[0].parameters()), ("embed", text.model.embed_tokens.parameters())]
    if "lm_head" in text:
        parts.append(("head", text.lm_head.parameters()))
    items = [f"{p}.{k}:{tuple(v.shape)}:{v.dtype}" for p, tree in parts for k, v in tree_flatten(tree)]
    digest = hashlib.sha1("\n".join(items).encode()).hexdigest()[:16]
    return f"{getattr(text, 'model_type', type(text).__module__)} x{len(layers)} {digest}"


def measure(probe, timer, samples):
    """(fused seconds, stock seconds) per call: `samples` each, interleaved, after warm-up."""
    inputs = [probe.make()]
    mx.eval(inputs)
    sides = (probe.fused, probe.stock)
    one = []
    for side in sides * 2:   # builds kernels, then a single call's time on the wall clock
        t0 = time.perf_counter()
        mx.eval(side(*inputs[0]))
        one.append(time.perf_counter() - t0)
    one = max(one[2:])
    reps = max(1, min(MAX_REPS, int(TARGET_S / max(one, 1e-6))))
    inputs += [probe.make() for _ in range(reps - 1)]
    mx.eval(inputs)
    times = {"fused": [], "stock": []}
    for i in range(samples):
        for name, side in (zip(("fused", "stock"), sides) if i % 2 == 0 else zip(("stock", "fused"), sides[::-1])):
            run = lambda side=side: mx.eval([side(*x) for x in inputs])
            times[name].append(timer(probe.fusion, name, run) / reps)
    return times["fused"], times["stock"]


def _say(tuner, text):
    if not tuner.quiet:
        print(f"[mlx_fastops tune] {text}", file=sys.stderr, flush=True)


def tune(text, recipe, backend, disabled, tuner, apply, remove):
    """The Tuning of a model: cached, or measured (apply(disabled) patches the model with those
    fusions off and returns the PatchState, remove() unpatches; the model is left unpatched)."""
    key = tune_cache.key(backend, disabled, tuner.shapes(), shape_class(text))
    if tuner.mode != "force":
        cached = tune_cache.load(key, Tuning.from_dict)
        if cached is not None:
            return cached
    t0 = time.perf_counter()
    _say(tuner, f"timing each fusion against stock on {key['device']} for this model's shapes (once; "
                f"the decisions are kept in {tune_cache.path()})")
    try:
        state = apply(disabled)
        decisions = _per_op(state, tuner)
        path = ops.backend_module(backend).DECODE_PATH
        fused = {e.fusion for e in state.report.fused}
        vocab = state.text.model.embed_tokens.weight.shape[0]   # a VL wrapper's args have no vocab_size
        if "prefill" in fused:
            decisions.update(_whole_prefill(state.model, vocab, disabled, decisions, tuner, apply, remove))
        if path is not None and "fast_decode" in fused:
            decisions.update(_whole_step(state.model, vocab, disabled, decisions, fused, path.parts, tuner, apply,
                                         remove))
    finally:
        remove()
    tuning = Tuning(key["device"], "measured", time.perf_counter() - t0, decisions)
    tune_cache.store(key, tuning.to_dict())
    _say(tuner, f"done in {tuning.seconds:.1f} s; off: {', '.join(sorted(tuning.off)) or 'none'}")
    return tuning


def _per_op(state, tuner):
    shapes = {}
    for probe in probes(state, tuner.rows, tuner.prefill, tuner.context):
        shapes.setdefault(probe.fusion, []).append(Shape(probe.shape, *measure(probe, tuner.timer, tuner.samples)))
    return {fusion: _judge(fusion, s) for fusion, s in shapes.items()}


def _rounds(tuner, variants, apply, remove, sample):
    """{variant: samples}: `rounds` rounds, each patching the model as every variant in turn
    (variants {name: disabled}; the first to go rotates) and appending sample(name) to its list."""
    names, out = list(variants), {name: [] for name in variants}
    for r in range(tuner.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            remove()
            apply(variants[name])
            out[name] += sample(name)
    return out


def _whole_prefill(model, vocab, disabled, decisions, tuner, apply, remove):
    """`prefill`, from whole prompt chunks (each tuning size, a fresh cache, evaluated as mlx-lm's
    prefill does: the cache, not the logits) of the model with the per-op fusions as tuned, with
    ("fused") and without ("stock") the backend's prefill path. An op alone would miss what the
    path keeps alive between calls, and how the calls overlap."""
    losers = {f for f, d in decisions.items() if not d.kept}
    prompts = {n: mx.random.randint(0, vocab, (1, n), key=mx.random.key(n)) for n in tuner.prefill}

    def sample(name):
        out = []
        for n, prompt in prompts.items():
            def run(prompt=prompt):
                cache = make_prompt_cache(model)
                model(prompt, cache=cache)
                mx.eval([c.state for c in cache])
            run()   # kernel builds
            out += [(n, tuner.timer("prefill", name, run)) for _ in range(tuner.steps)]
        return out

    times = _rounds(tuner, {"fused": disabled | losers, "stock": disabled | losers | {"prefill"}}, apply, remove,
                    sample)
    per = lambda name, n: [t for m, t in times[name] if m == n]
    return {"prefill": _judge_prefill([(n, Shape(f"prefill {n}", per("fused", n), per("stock", n)))
                                       for n in tuner.prefill])}


def _whole_step(model, vocab, disabled, decisions, fused, parts, tuner, apply, remove):
    """fast_decode and compile, from decode steps of the model patched three ways: the per-op
    path as tuned ("composed"), with fast_decode ("fast"), and with the compiled step too."""
    losers = {f for f, d in decisions.items() if not d.kept}
    others = losers - set(parts)   # the fast path needs its parts on
    variants = {"composed": disabled | losers | {"fast_decode", "compile"}, "fast": disabled | others | {"compile"}}
    if "compile" in fused:
        variants["compiled"] = disabled | others
    prompt = mx.random.randint(0, vocab, (1, tuner.context), key=mx.random.key(0))
    token = mx.array([[1]])

    def sample(name):
        cache = make_prompt_cache(model)
        mx.eval(model(prompt, cache=cache))
        for _ in range(2):   # kernel builds, the compiled step's trace
            mx.eval(model(token, cache=cache))
        return [tuner.timer("fast_decode", name, lambda: mx.eval(model(token, cache=cache)))
                for _ in range(tuner.steps)]

    times = _rounds(tuner, variants, apply, remove, sample)
    label = f"decode step B=1 @{tuner.context}"
    best = "compiled" if "compiled" in times and statistics.median(times["compiled"]) < statistics.median(times["fast"]) \
        else "fast"
    out = {"fast_decode": _judge("fast_decode", [Shape(label, times[best], times["composed"])])}
    if "compiled" in times:
        out["compile"] = _judge("compile", [Shape(label, times["compiled"], times["fast"])])
        if not out["fast_decode"].kept and out["compile"].kept:
            out["compile"] = Decision("compile", False, "needs fast_decode, which is off", out["compile"].shapes)
    if out["fast_decode"].kept:
        for part in set(parts) & set(decisions):
            d = decisions[part]
            if not d.kept:
                out[part] = Decision(part, True, f"kept: part of fast_decode ({d.note})", d.shapes)
    return out
