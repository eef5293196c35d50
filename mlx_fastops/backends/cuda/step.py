"""The CUDA whole-model decode path: FastBlocks, their StaticKVCache, and one mx.compile'd step.

`DECODE_PATH` implements mlx_fastops.backends.DecodePath for the patcher. Once every decoder block
has a FastBlock, the model's make_cache returns StaticKVCaches and model.model's class is swapped
for one whose decode call over those caches (`_Step.takes`: B * L <= MAX_ROWS tokens, or a decode
step of up to QMM_MAX_ROWS rows) is one compiled function: embedding, the layers, final norm. Up
to MAX_ROWS tokens the layers are the one-launch layers (consecutive small layers sharing one, large
ones at up to LARGE_SHARED_MAX_ROWS rows: launch_runs); decode steps of more rows run FastBlock.wide's
five launches a layer (qmm on tensor cores), unless the `prefill` switch (qmm's) is off.
generate_step's kv_bits converts them to StaticQuantizedKVCaches (4/8 bits), which the same step
takes up to MAX_ROWS rows (the one-launch layers quantising each new k/v row); mlx-lm's
BatchGenerator merges them into StaticBatchKVCaches (left-padded rows, one write index), which the
same step takes (the kernels given each row's left padding); anything else takes the composed
fused ops.
The step also computes the next cache offset on the GPU (a host-made offset array faults once on
first use: source.OFF_WORDS).

The step holds the arrays it was traced with. It runs only while the blocks' Watch is fast (see
mlx_fastops.modules.Watch: nothing the patch was built from was written) and the model's layers
are still its blocks' owners; otherwise the Watch rebuilds the patch (a new step, or none) first.
That check is one attribute and one identity per layer, at C speed, per decode step.
"""

import operator
from functools import partial

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from .. import DecodePath
from .block import FastBlock
from .cache import StaticBatchKVCache, StaticKVCache, StaticQuantizedKVCache
from .layer import layers_launch
from .source import MAX_ROWS, offset_array

# The fast path fuses all of these; switching any of them off switches it off (qkv / gate_up off
# leave no stacked weights, which FastBlock.unsupported would also refuse: named, the report says why).
FAST_PATH_PARTS = ("qkv", "gate_up", "attention", "qk_norm_rope", "residual_norm")


def _compiled_call(self, inputs, cache=None, input_embeddings=None):
    step = self.__dict__.get("_fastops_step")
    if (step is not None and input_embeddings is None and cache is not None and inputs.ndim == 2
            and step.takes(*inputs.shape)):
        watch, layers = step.watch, dict.__getitem__(self, "layers")
        if (not watch.fast or len(layers) != len(step.owners)
                or not all(map(operator.is_, layers, step.owners))):
            # The model changed (or is in training mode): bring the patch up to date, which may
            # rebuild this step or remove it, and dispatch again; else the stock composition.
            if watch.fast:
                watch.changed()
            if watch.ready():
                return self(inputs, cache=cache, input_embeddings=input_embeddings)
        elif _fast_caches(step.blocks, cache, inputs.shape[0]):
            B, L = inputs.shape
            prev = cache[0].position()
            bufs = []
            for fb, c in zip(step.blocks, cache):
                c.reserve(B, fb.HKV, fb.D, fb.dtype, prev + L)
                bufs.extend(c.fast_inputs())
            dev = self.__dict__.get("_fastops_off")   # (position, int32 array on the GPU)
            off = dev[1] if dev is not None and dev[0] == prev else offset_array(prev)
            h, off_next, *readers = step.fn(inputs, off, *bufs)
            object.__setattr__(self, "_fastops_off", (prev + L, off_next))
            for c, r in zip(cache, readers):
                c.advance(L, r)
            return h
    return type(self)._fastops_base.__call__(self, inputs, cache=cache, input_embeddings=input_embeddings)


def _fast_caches(blocks, cache, B):
    """Whether the decode step takes B rows over `cache`: one cache per block, all StaticKVCache,
    all StaticQuantizedKVCache or all StaticBatchKVCache, at one write position, each able to take
    the rows."""
    kind = type(cache[0])
    if kind not in (StaticKVCache, StaticQuantizedKVCache, StaticBatchKVCache) or len(cache) != len(blocks):
        return False
    pos = cache[0].position()
    # one quantised format for all: a launch of several layers takes its format from the first
    fmt = lambda c: (c.bits, c.group_size) if kind is StaticQuantizedKVCache else None
    return all(type(c) is kind and c.position() == pos and fmt(c) == fmt(cache[0])
               and c.takes(B, fb.HKV, fb.D, fb.dtype) for c, fb in zip(cache, blocks))


class _Step:
    """The compiled decode step, the FastBlocks it runs and the FusedBlocks they belong to (the
    model's layers while it is valid), and their Watch. A copy of the model gets none: its Watch
    is stale and rebuilds the step from the copy's own arrays."""

    def __init__(self, fn, blocks, watch, max_rows):
        self.fn, self.blocks, self.watch, self.max_rows = fn, blocks, watch, max_rows
        self.owners = [fb.owner for fb in blocks]

    def takes(self, B, L):
        """B sequences of L new tokens: up to MAX_ROWS tokens, or decode steps (L = 1) of up to
        max_rows rows (prompt chunks of more tokens stay composed: FastBlock.wide's kernels are
        built per L)."""
        return B * L <= MAX_ROWS or (L == 1 and B <= self.max_rows)

    def __deepcopy__(self, memo):
        return None


_INNER_CLASSES = {}


# Steps of up to this many rows (B * L) run consecutive large layers (not `grouped`:
# block.GROUP_MAX_WEIGHTS) of one launch_key in one launch; larger steps one launch each. At one row
# the shared launch keeps decode GPU-bound where the host is slow to issue 36 launches a step (H100,
# cuda_ab.py --set step.LARGE_SHARED_MAX_ROWS=0,1: Qwen3-4B tg128 374 -> 487, 8B 338 -> 386 tok/s);
# at 4 and 8 rows it cost Qwen3-8B 1-6% (docs/cuda-design.md, "Layers per launch").
LARGE_SHARED_MAX_ROWS = 1

# A launch's layers pass their arrays as kernel parameters, which NVRTC bounds at 32 KB; a layer over
# a quantised cache passes ~670 bytes (tests/cuda_compile_check.py builds 40 such layers in one).
MAX_LAYERS_PER_LAUNCH = 40


def launch_runs(fasts, rows):
    """[(first block, blocks)] in order, for a step of `rows` rows: up to MAX_LAYERS_PER_LAUNCH
    consecutive blocks of one launch_key share a launch where they are `grouped`, or large and
    rows <= LARGE_SHARED_MAX_ROWS."""
    runs, i = [], 0
    while i < len(fasts):
        cap = MAX_LAYERS_PER_LAUNCH if fasts[i].grouped or rows <= LARGE_SHARED_MAX_ROWS else 1
        n = 1
        while (n < cap and i + n < len(fasts) and fasts[i + n].grouped == fasts[i].grouped
               and fasts[i + n].launch_key() == fasts[i].launch_key()):
            n += 1
        runs.append((i, n))
        i += n
    return runs


def _launches_note(runs):
    """{rows: runs} -> '1 launch at 1 row, 36 launches at 2-8 rows' ('36 launches' where all agree)."""
    by_count = {}   # launches a step -> the row counts that take that many
    for rows, rr in runs.items():
        by_count.setdefault(len(rr), []).append(rows)
    name = lambda k: f"{k} launch{'es' if k > 1 else ''}"
    span = lambda rs: f"{rs[0]}-{rs[-1]} rows" if len(rs) > 1 else f"{rs[0]} row{'s' if rs[0] > 1 else ''}"
    if len(by_count) == 1:
        return name(len(runs[1]))
    return ", ".join(f"{name(k)} at {span(rs)}" for k, rs in by_count.items())


def _inner(model):
    """The decoder stack (embed_tokens, layers, norm): model.model, or a vision-language
    wrapper's language_model.model."""
    return model.get("language_model", model).get("model")


def _compile_step(model, fasts, wide):
    """The class swap of the decoder stack for one whose decode step is one mx.compile'd
    function: ((obj, stock class, fast class, _Step), note), or (None, reason). wide: whether the
    step takes decode steps of more rows through FastBlock.wide, where every block's does (the
    `prefill` switch, qmm's, on: a bound the tuner put on it is about prompt chunks, and these
    steps replace the composed ops, not stock's)."""
    inner = _inner(model)
    if inner is None or "embed_tokens" not in inner or "norm" not in inner:
        return None, "no inner model with embed_tokens/norm"
    if getattr(inner, "pipeline_size", 1) != 1:
        return None, "pipeline-parallel model"
    embed, norm = inner.embed_tokens, inner.norm
    dtype = fasts[0].dtype
    # An embedding in another dtype would make stock and fused paths differ: require a match.
    if getattr(embed, "scales", getattr(embed, "weight", None)).dtype != dtype:
        return None, "embedding dtype differs from the layers'"
    runs = {rows: launch_runs(fasts, rows) for rows in range(1, MAX_ROWS + 1)}
    max_rows = min(fb.wide_rows for fb in fasts) if wide else MAX_ROWS
    # FastBlock.wide: each block's down makes the next block's normalised input, the last block's
    # the final norm's where it is nn.RMSNorm's (a watched subclass: the same call) in the layers' dtype
    plain = isinstance(norm, nn.RMSNorm) and type(norm).__call__ is nn.RMSNorm.__call__
    final = (norm.weight, float(norm.eps)) if plain and norm.weight.dtype == dtype else None
    next_norms = [fb.in_norm for fb in fasts[1:]] + [final]

    def step(tokens, off, *bufs):
        # bufs: per layer its cache's fast_inputs() (layer.layers_launch)
        per = len(bufs) // len(fasts)
        layer_bufs = [bufs[per * k:per * k + per] for k in range(len(fasts))]
        h = embed(tokens)
        if h.dtype != dtype:
            h = h.astype(dtype)
        readers = []
        # (a guard: a quantised cache, uint32 buffers, takes at most MAX_ROWS rows: its `takes`)
        if tokens.shape[1] == 1 and tokens.shape[0] > MAX_ROWS and bufs[0].dtype != mx.uint32:
            hn = mx.fast.rms_norm(h, *fasts[0].in_norm)
            for fb, b, nxt in zip(fasts, layer_bufs, next_norms):
                h, hn = fb.wide(h, hn, nxt, off, *b)
                readers.append(h)   # after every kernel of the block (wide's reader rule)
            if final is not None:
                return [hn, off + tokens.shape[1], *readers]
        else:
            for i, n in runs[tokens.shape[0] * tokens.shape[1]]:
                h, o = layers_launch(fasts[i:i + n], h, off, layer_bufs[i:i + n])
                readers += [o] * n
        return [norm(h), off + tokens.shape[1], *readers]

    base = type(inner)
    cls = _INNER_CLASSES.get(base)
    if cls is None:
        cls = _INNER_CLASSES[base] = type(f"FastStep{base.__name__}", (base,),
                                          {"__call__": _compiled_call, "_fastops_base": base})
    launches = _launches_note(runs)
    why = "prefill off" if not wide else "a weight qmm does not take"
    rows = (f"; decode steps of {MAX_ROWS + 1}-{max_rows} rows: 5 launches a layer" if max_rows > MAX_ROWS else
            f"; decode steps of over {MAX_ROWS} rows: the composed ops ({why})")
    return ((inner, base, cls, _Step(mx.compile(step), fasts, fasts[0].watch, max_rows)),
            f"{len(fasts)} layers in {launches}{rows}")


class Installed:
    """What CudaDecodePath.install changed on a model: remove() undoes it, restore() redoes it."""

    def __init__(self, model, make_cache, step):
        self.model, self.make_cache, self.step = model, make_cache, step

    def remove(self):
        self.model.__dict__.pop("make_cache", None)
        if self.step:
            obj, stock, _, _ = self.step
            for name in ("_fastops_step", "_fastops_blocks", "_fastops_off"):
                obj.__dict__.pop(name, None)
            obj.__class__ = stock

    def restore(self):
        object.__setattr__(self.model, "make_cache", self.make_cache)
        if self.step:
            obj, _, fast, step = self.step
            object.__setattr__(obj, "_fastops_step", step)
            object.__setattr__(obj, "_fastops_blocks", step.blocks)   # the FastBlocks, in layer order
            obj.__class__ = fast


class CudaDecodePath(DecodePath):
    """mlx_fastops.backends.DecodePath for MLX's CUDA backend."""

    parts = FAST_PATH_PARTS

    def block(self, fused_block, disabled):
        off = [n for n in FAST_PATH_PARTS if n in disabled]
        if off:
            return None, f"parts disabled: {','.join(off)}"
        reason = FastBlock.unsupported(fused_block)
        return (None, reason) if reason else (FastBlock(fused_block), None)

    def install(self, model, fasts, disabled):
        if hasattr(model, "make_cache") and any(type(c) is not KVCache for c in model.make_cache()):
            return None, [("fast_decode", "skipped", "the model's own caches are not all KVCache")]
        make_cache = partial(_static_caches, len(fasts))
        if "compile" in disabled:
            step, row = None, ("compile", "skipped", "disabled")
        elif any(f is None for f in fasts):
            step, row = None, ("compile", "skipped", "not every block has the fast path")
        else:
            step, note = _compile_step(model, fasts, "prefill" not in disabled)
            row = ("compile", "fused" if step else "skipped", note)
        installed = Installed(model, make_cache, step)
        installed.restore()
        return installed, [row]


def _static_caches(n):
    return [StaticKVCache() for _ in range(n)]


DECODE_PATH = CudaDecodePath()
