"""Metal RMSNorm with the residual add fused, and q/k RMSNorm + RoPE in one kernel (metal/norm_rope.metal).

  rms_norm_residual(x, residual, weight, eps) -> (h = residual + x, rms_norm(h) * weight)
      one threadgroup per row (1-4 rows at decode, L rows at prefill), h kept in registers;
  qk_norm_rope(q [B,L,H,D], k [B,L,Hkv,D], q_norm, k_norm, eps, rope, offset) -> q [B,H,L,D], k [B,Hkv,L,D]
      one SIMD-group per (token, head) row over q and k heads together (one dispatch instead of
      stock's four), RoPE from an inverse-frequency array and the position offset (an int32 array,
      never a template argument); nn.RoPE traditional and half-split, Llama-3 `freqs`.

Cases outside the kernels (dtype mismatches, per-batch offsets) run the reference op.
"""

import functools
import math

import mlx.core as mx
import numpy as np

from ... import kernels
from .. import reference

SOURCE = "norm_rope.metal"
HEAD_DIMS = (64, 128, 256)
MAX_HIDDEN = 16384
_FLOATS = (mx.float16, mx.bfloat16, mx.float32)


def sections(filename):
    """{section name: text} of a sectioned metal/*.metal file (see kernels.sections)."""
    return kernels.sections("metal", filename)


# ---------------------------------------------------------------------------------------------
# RMSNorm + residual


def _norm_threads(hidden):
    """Threads per row (MLX's rms_norm rule: 4 elements a thread, whole SIMD-groups, <= 1024)."""
    tg = min(1024, max(32, -(-hidden // (4 * 32)) * 32))
    return tg, -(-hidden // tg)


@kernels.cached_builder
def _rms_kernel(dtype):
    s = sections(SOURCE)
    return kernels.metal_kernel(
        name=f"fastops_rms_norm_residual_{kernels.dtype_tag(dtype)}",
        input_names=["x", "residual", "weight", "eps"],
        output_names=["h", "n"],
        source=s["rms_norm_residual"],
        header=s["header"],
    )


def unsupported_rms_norm_residual(hidden=None, dtype=None, **_):
    if hidden is not None and hidden > MAX_HIDDEN:
        return f"hidden size {hidden} > {MAX_HIDDEN}"
    if dtype is not None and dtype not in _FLOATS:
        return f"dtype {dtype}"
    return None


def rms_norm_residual(x, residual, weight, eps):
    hidden = x.shape[-1]
    if (x.dtype != residual.dtype or weight.dtype != x.dtype or x.shape != residual.shape
            or hidden > MAX_HIDDEN or x.dtype not in _FLOATS):
        return reference.rms_norm_residual(x, residual, weight, eps)
    rows = x.size // hidden
    tg, n_per = _norm_threads(hidden)
    h, n = _rms_kernel(x.dtype)(
        inputs=[x, residual, weight, float(eps)],
        template=[("T", x.dtype), ("HIDDEN", hidden), ("TG", tg), ("N_PER", n_per)],
        grid=(rows * tg, 1, 1),
        threadgroup=(tg, 1, 1),
        output_shapes=[x.shape, x.shape],
        output_dtypes=[x.dtype, x.dtype],
    )
    return h, n


# ---------------------------------------------------------------------------------------------
# q/k RMSNorm + RoPE

_ROWS_PER_TG = 4  # SIMD-groups (rows) per threadgroup


@kernels.cached_builder
def _qk_kernel(dtype):
    s = sections(SOURCE)
    return kernels.metal_kernel(
        name=f"fastops_qk_norm_rope_{kernels.dtype_tag(dtype)}",
        input_names=["q", "k", "q_w", "k_w", "inv_freq", "offset", "eps", "scale"],
        output_names=["q_out", "k_out"],
        source=s["qk_norm_rope"],
        header=s["header"],
        ensure_row_contiguous=False,  # q/k are views of the fused QKV output: read them in place
    )


_inv_freq_cache = {}


def inv_freq(rope):
    """float32 [dims/2] inverse frequencies of a RopeSpec, as MLX's rope kernel computes them:
    exp2(-(i / (dims/2)) * log2(base)), or 1 / freqs[i] (Llama-3 periods). Cached per spec."""
    key = (rope.dims, rope.base, id(rope.freqs) if rope.freqs is not None else None)
    hit = _inv_freq_cache.get(key)
    if hit is not None and hit[0] is rope.freqs:
        return hit[1]
    half = rope.dims // 2
    if rope.freqs is not None:
        f = 1.0 / rope.freqs.astype(mx.float32)
    else:
        d = np.arange(half, dtype=np.float32) / np.float32(half)
        f = mx.array(np.exp2(-d * np.float32(math.log2(rope.base))).astype(np.float32))
    mx.eval(f)
    _inv_freq_cache[key] = (rope.freqs, f)
    return f


@functools.lru_cache(maxsize=None)
def _dummy_weight(dtype, d):
    """Ones standing in for the norm weights when NORM is off (built once: this is the hot path)."""
    w = mx.ones((d,), dtype=dtype)
    mx.eval(w)
    return w


def unsupported_qk_norm_rope(head_dim=None, rope=None, norm=None, dtype=None, **_):
    if head_dim is not None and head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} (kernel: {HEAD_DIMS})"
    if rope is not None:
        if rope.freqs is None and rope.base is None:
            return "RoPE without base or freqs"
        if head_dim is not None and rope.dims > head_dim:
            return f"RoPE dims {rope.dims} > head_dim {head_dim}"
        if rope.traditional and rope.dims % 2:
            return f"odd RoPE dims {rope.dims}"
        if not rope.traditional and rope.dims % 64:
            return f"partial half-split RoPE with dims {rope.dims} not a multiple of 64"
    if dtype is not None and dtype not in _FLOATS:
        return f"dtype {dtype}"
    return None


def qk_norm_rope(q, k, q_norm, k_norm, eps, rope, offset):
    D = q.shape[-1]
    if isinstance(offset, mx.array):
        if offset.size != 1:  # per-sequence offsets (batched caches)
            return reference.qk_norm_rope(q, k, q_norm, k_norm, eps, rope, offset)
        off = offset.reshape(()).astype(mx.int32)
    else:
        off = mx.array(int(offset), dtype=mx.int32)
    norm = q_norm is not None
    if (unsupported_qk_norm_rope(D, rope, norm, q.dtype) or k.dtype != q.dtype or k.shape[-1] != D
            or (norm and (q_norm.dtype != q.dtype or k_norm.dtype != q.dtype))):
        return reference.qk_norm_rope(q, k, q_norm, k_norm, eps, rope, offset)
    B, L, H, _ = q.shape
    Hk = k.shape[2]
    rows = B * L * (H + Hk)
    if norm:
        qw, kw = q_norm, k_norm
    else:
        qw = kw = _dummy_weight(q.dtype, D)
    qo, ko = _qk_kernel(q.dtype)(
        inputs=[q, k, qw, kw, inv_freq(rope), off, float(eps), float(rope.scale)],
        template=[("T", q.dtype), ("D", D), ("DIMS", rope.dims), ("TRAD", bool(rope.traditional)),
                  ("NORM", norm)],
        grid=(32, rows, 1),
        threadgroup=(32, min(_ROWS_PER_TG, rows), 1),
        output_shapes=[(B, H, L, D), (B, Hk, L, D)],
        output_dtypes=[q.dtype, q.dtype],
    )
    return qo, ko
