"""The CUDA whole-model decode path: FastBlocks, their StaticKVCache, and one mx.compile'd step.

`DECODE_PATH` implements mlx_fastops.backends.DecodePath for the patcher. Once every decoder block
has a FastBlock, the model's make_cache returns StaticKVCaches and model.model's class is swapped
for one whose decode call (B * L <= MAX_ROWS tokens over those caches) is one compiled function:
embedding, the layer launches (consecutive small layers sharing one: launch_runs), final norm.
The step also computes the next cache offset on the GPU (a host-made offset array faults once on
first use: source.OFF_WORDS).
"""

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from .. import DecodePath
from .block import FastBlock
from .cache import StaticKVCache
from .layer import layers_launch
from .source import MAX_ROWS, offset_array

# The fast path fuses all of these; switching any of them off switches it off.
FAST_PATH_PARTS = ("qkv", "gate_up", "attention", "qk_norm_rope", "residual_norm")


def _compiled_call(self, inputs, cache=None, input_embeddings=None):
    step = self.__dict__.get("_fastops_step")
    if (step is not None and input_embeddings is None and cache is not None and inputs.ndim == 2
            and inputs.shape[0] * inputs.shape[1] <= MAX_ROWS):
        blocks = self._fastops_blocks
        c0 = cache[0]
        if (type(c0) is StaticKVCache and len(cache) == len(blocks)
                and all(type(c) is StaticKVCache and c.offset == c0.offset for c in cache)):
            B, L = inputs.shape
            prev = c0.offset
            bufs = []
            for fb, c in zip(blocks, cache):
                c.reserve(B, fb.HKV, fb.D, fb.dtype, prev + L)
                bufs.extend(c.fast_inputs())
            dev = self.__dict__.get("_fastops_off")   # (offset value, int32 array on the GPU)
            off = dev[1] if dev is not None and dev[0] == prev else offset_array(prev)
            h, off_next, *readers = step(inputs, off, *bufs)
            object.__setattr__(self, "_fastops_off", (prev + L, off_next))
            for c, r in zip(cache, readers):
                c.offset = prev + L
                c.last_reader = r
            return h
    return super(self.__class__, self).__call__(inputs, cache=cache, input_embeddings=input_embeddings)


_INNER_CLASSES = {}


def launch_runs(fasts):
    """[(first block, blocks)] in order: consecutive `grouped` blocks of one launch_key share a
    launch; any other block has one of its own."""
    runs, i = [], 0
    while i < len(fasts):
        n = 1
        if fasts[i].grouped:
            while (i + n < len(fasts) and fasts[i + n].grouped
                   and fasts[i + n].launch_key() == fasts[i].launch_key()):
                n += 1
        runs.append((i, n))
        i += n
    return runs


def _compile_step(model, fasts):
    """Swap model.model's class for one whose decode step is one mx.compile'd function. Returns
    ((obj, stock class, fast class), note) or (None, reason)."""
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "embed_tokens") or not hasattr(inner, "norm"):
        return None, "no inner model with embed_tokens/norm"
    if getattr(inner, "pipeline_size", 1) != 1:
        return None, "pipeline-parallel model"
    embed, norm = inner.embed_tokens, inner.norm
    dtype = fasts[0].dtype
    # An embedding in another dtype would make stock and fused paths differ: require a match.
    if getattr(embed, "scales", getattr(embed, "weight", None)).dtype != dtype:
        return None, "embedding dtype differs from the layers'"
    runs = launch_runs(fasts)

    def step(tokens, off, *bufs):
        h = embed(tokens)
        if h.dtype != dtype:
            h = h.astype(dtype)
        readers = []
        for i, n in runs:
            h, o = layers_launch(fasts[i:i + n], h, off, [bufs[3 * k:3 * k + 3] for k in range(i, i + n)])
            readers += [o] * n
        return [norm(h), off + tokens.shape[1], *readers]

    base = type(inner)
    cls = _INNER_CLASSES.get(base)
    if cls is None:
        cls = _INNER_CLASSES[base] = type(f"FastStep{base.__name__}", (base,), {"__call__": _compiled_call})
    object.__setattr__(inner, "_fastops_step", mx.compile(step))
    object.__setattr__(inner, "_fastops_blocks", fasts)
    inner.__class__ = cls
    return (inner, base, cls), f"{len(fasts)} layers in {len(runs)} launch{'es' if len(runs) > 1 else ''}"


class Installed:
    """What CudaDecodePath.install changed on a model: remove() undoes it, restore() redoes it."""

    def __init__(self, model, make_cache, step):
        self.model, self.make_cache, self.step = model, make_cache, step

    def remove(self):
        self.model.__dict__.pop("make_cache", None)
        if self.step:
            obj, stock, _ = self.step
            obj.__class__ = stock

    def restore(self):
        object.__setattr__(self.model, "make_cache", self.make_cache)
        if self.step:
            obj, _, fast = self.step
            obj.__class__ = fast


class CudaDecodePath(DecodePath):
    """mlx_fastops.backends.DecodePath for MLX's CUDA backend."""

    def block(self, fused_block, disabled):
        off = [n for n in FAST_PATH_PARTS if n in disabled]
        if off:
            return None, f"parts disabled: {','.join(off)}"
        reason = FastBlock.unsupported(fused_block)
        return (None, reason) if reason else (FastBlock(fused_block), None)

    def install(self, model, fasts, disabled):
        if hasattr(model, "make_cache") and any(type(c) is not KVCache for c in model.make_cache()):
            return None, [("fast_decode", "skipped", "the model's own caches are not all KVCache")]
        make_cache = lambda: [StaticKVCache() for _ in model.layers]
        object.__setattr__(model, "make_cache", make_cache)
        if "compile" in disabled:
            return Installed(model, make_cache, None), [("compile", "skipped", "disabled")]
        if any(f is None for f in fasts):
            return Installed(model, make_cache, None), [("compile", "skipped", "not every block has the fast path")]
        step, note = _compile_step(model, fasts)
        return Installed(model, make_cache, step), [("compile", "fused" if step else "skipped", note)]


DECODE_PATH = CudaDecodePath()
