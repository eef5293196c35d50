"""Metal quantised GEMV family: Q/K/V in one dispatch, gate/up + SiLU in one dispatch, lm_head.

Kernel bodies and helpers live in metal/gemv.metal (see its header comment for the work split).
Decode only: 1 to 8 activation rows (MAX_ROWS); a call with more rows, or with an activation dtype
other than the weights' scales, runs the reference op instead (same result, stock kernels).

Static shape classes the kernels do not take (float weights, bits other than 4/8, group sizes other
than 32/64/128, float32 models, tiny layers) are refused by the `unsupported_*` predicates, so the
patcher falls back to the reference op and reports why.
"""

import functools
import math

import mlx.core as mx

from ... import kernels
from .. import reference

MAX_ROWS = 8
_ROW_BUCKETS = (1, 2, 4, 8)
_THREADS = 64  # two SIMD-groups
_ROWS_PER_TG = 8  # weight rows per threadgroup (plain and qkv)
_OUTS_PER_TG_GATE_UP = 4  # outputs per threadgroup for gate/up (2 gate + 2 up rows per SIMD-group)
BITS = (4, 8)
GROUPS = (32, 64, 128)
DTYPES = (mx.float16, mx.bfloat16)

_OUTPUTS = {"gemv": ["out"], "gate_up": ["y"], "qkv": ["q", "k", "v"]}
INPUTS = ["x", "w", "scales", "biases", "bias", "params"]


# ---------------------------------------------------------------------------------------------
# kernel objects


@functools.lru_cache(maxsize=None)
def sections():
    """(header, {kind: body}) of metal/gemv.metal: each body is the shared `prologue` followed by
    the kind's section."""
    s = kernels.sections("metal", "gemv.metal")
    return s["header"], {kind: s["prologue"] + s[kind] for kind in _OUTPUTS}


@kernels.cached_builder
def build(kind, dtype):
    """One kernel object per (kernel, dtype): mlx#3662 advises against mixing dtypes."""
    header, bodies = sections()
    return kernels.metal_kernel(
        name=f"fastops_{kind}",
        input_names=INPUTS,
        output_names=_OUTPUTS[kind],
        source=bodies[kind],
        header=header,
    )


@functools.lru_cache(maxsize=512)
def _params(k, gs, m, has_bias, n0, n1=0, n2=0, t0=0, t1=0):
    return mx.array([k, gs, m, int(has_bias), n0, n1, n2, t0, t1], dtype=mx.int32)


@functools.lru_cache(maxsize=None)
def _no_bias(dtype):
    # 8 elements: inputs under 8 elements are passed in the `constant` address space, which the
    # kernel's `const device T*` helpers would not accept on Metal.
    return mx.zeros((8,), dtype=dtype)


def _bias(w, dtype):
    if w.bias is None:
        return _no_bias(dtype), False
    b = w.bias
    if b.size < 8:
        b = mx.concatenate([b, mx.zeros((8 - b.size,), dtype=b.dtype)])
    return b.astype(dtype), True


def row_bucket(m):
    for r in _ROW_BUCKETS:
        if m <= r:
            return r
    raise ValueError(f"{m} activation rows; the GEMV kernels take at most {MAX_ROWS}")


def _rows(x, w):
    """x as [M, K] when the kernels take this call, else None (the wrapper falls back)."""
    if w.bits not in BITS or w.group_size not in GROUPS or x.dtype not in DTYPES:
        return None
    k = x.shape[-1]
    m = x.size // k if k else 0
    # Inputs under 8 elements would arrive in `constant` memory, which the bodies do not take.
    if not 1 <= m <= MAX_ROWS or x.dtype != w.scales.dtype or min(x.size, w.scales.size) < 8:
        return None
    return x.reshape(m, k)


def _template(dtype, bits, m):
    return [("T", dtype), ("BITS", bits), ("MR", row_bucket(m))]


def _launch(kind, x2, w, params, tiles, out_shapes):
    kern = build(kind, x2.dtype)
    bias, _ = _bias(w, x2.dtype)
    return kern(
        inputs=[x2, w.weight, w.scales, w.biases, bias, params],
        template=_template(x2.dtype, w.bits, x2.shape[0]),
        grid=(tiles * _THREADS, 1, 1),
        threadgroup=(_THREADS, 1, 1),
        output_shapes=out_shapes,
        output_dtypes=[x2.dtype] * len(out_shapes),
    )


# ---------------------------------------------------------------------------------------------
# ops (reference signatures)


def gemv(x, w):
    """x @ W^T (+ bias) for a quantised PackedLinear: [..., K] -> [..., N]."""
    x2 = _rows(x, w)
    if x2 is None:
        return reference.linear(x, w)
    m, k = x2.shape
    n = w.out_features
    params = _params(k, w.group_size, m, w.bias is not None, n)
    (out,) = _launch("gemv", x2, w, params, math.ceil(n / _ROWS_PER_TG), [(m, n)])
    return out.reshape(*x.shape[:-1], n)


def lm_head(x, w):
    return gemv(x, w)


def qkv_proj(x, w):
    x2 = _rows(x, w)
    if x2 is None:
        return reference.qkv_proj(x, w)
    m, k = x2.shape
    nq, nk, nv = w.splits
    tq, tk, tv = (math.ceil(n / _ROWS_PER_TG) for n in (nq, nk, nv))
    params = _params(k, w.group_size, m, w.bias is not None, nq, nk, nv, tq, tq + tk)
    outs = _launch("qkv", x2, w, params, tq + tk + tv, [(m, nq), (m, nk), (m, nv)])
    lead = x.shape[:-1]
    return tuple(o.reshape(*lead, n) for o, n in zip(outs, (nq, nk, nv)))


def gate_up_silu(x, w):
    x2 = _rows(x, w)
    if x2 is None:
        return reference.gate_up_silu(x, w)
    m, k = x2.shape
    ni = w.splits[0]
    params = _params(k, w.group_size, m, w.bias is not None, ni)
    tiles = math.ceil(ni / _OUTS_PER_TG_GATE_UP)
    (y,) = _launch("gate_up", x2, w, params, tiles, [(m, ni)])
    return y.reshape(*x.shape[:-1], ni)


# ---------------------------------------------------------------------------------------------
# static support (patch time)


def unsupported_linear(in_features, splits, bits, group_size, dtype, bias=False, **_):
    """Why the GEMV kernels cannot take this shape class, or None."""
    if bits is None:
        return "float weights (the Metal GEMV kernels take affine-quantised weights)"
    if bits not in BITS or group_size not in GROUPS:
        return f"bits={bits}, group_size={group_size} (Metal GEMV: bits {BITS}, groups {GROUPS})"
    if dtype not in DTYPES:
        return f"dtype {dtype} (Metal GEMV: float16, bfloat16)"
    if in_features % group_size:
        return f"in_features {in_features} is not a multiple of group_size {group_size}"
    n = sum(splits)
    if min(splits) < 1 or n * (in_features // group_size) < 8 or n * in_features * bits // 32 < 8:
        return f"layer too small ({n} x {in_features})"
    return None


def unsupported_qkv_proj(**info):
    if len(info.get("splits", ())) != 3:
        return f"qkv needs 3 output segments, got {info.get('splits')}"
    return unsupported_linear(**info)


def unsupported_gate_up_silu(**info):
    s = info.get("splits", ())
    if len(s) != 2 or s[0] != s[1]:
        return f"gate/up needs 2 equal output segments, got {s}"
    return unsupported_linear(**info)


def unsupported_lm_head(**info):
    return unsupported_linear(**info)


def instantiations():
    """Every (kernel, dtype, bits, row bucket) the wrappers can launch: the compile tier."""
    return [(kind, dtype, bits, mr) for kind in _OUTPUTS for dtype in DTYPES for bits in BITS
            for mr in _ROW_BUCKETS]
