"""Fused ops: one function per op, one signature for every backend.

Each public function validates its inputs (clear ValueError/TypeError) and runs the op on the
backend chosen by `select`. Fused modules call `select` once at patch time and keep the returned
function, so the decode hot path pays no validation or dispatch cost.

Shapes (B batch, L tokens, H query heads, Hkv kv heads, D head_dim, S cache length):
  qkv_proj(x[B,L,K], w)                      -> q[B,L,Nq], k[B,L,Nk], v[B,L,Nv]
  gate_up_silu(x[B,L,K], w)                  -> silu(x@Wg^T) * (x@Wu^T)  [B,L,I]
  rms_norm_residual(x, residual, weight, eps) -> (h = residual + x, rms_norm(h) * weight)
  qk_norm_rope(q[B,L,H,D], k[B,L,Hkv,D], q_norm, k_norm, eps, rope, offset)
                                             -> q[B,H,L,D], k[B,Hkv,L,D]  (norm optional)
  decode_attention(q[B,H,1,D], k_cache[B,Hkv,S,D], v_cache, length, scale) -> [B,H,1,D]
  flash_attention(q[B,H,L,D], k[B,Hkv,S,D], v, scale, mask)               -> [B,H,L,D]
  quantized_attention(q, q_keys, q_values, scale, mask, group_size, bits) -> [B,H,L,D]
      over mlx-lm's QuantizedKVCache tuples (packed uint32, scales, biases), each [B,Hkv,S,...]
  lm_head(x[B,L,K], w)                       -> logits [B,L,vocab]
  linear(x[B,L,K], w)                        -> x @ W^T (+ bias)  [B,L,N]  (o_proj, down_proj)
"""

import importlib

import mlx.core as mx

from ..config import backend_name
from .weights import PackedLinear, RopeSpec

OPS = (
    "qkv_proj",
    "gate_up_silu",
    "rms_norm_residual",
    "qk_norm_rope",
    "decode_attention",
    "flash_attention",
    "quantized_attention",
    "lm_head",
    "linear",
)

_FLOAT_DTYPES = (mx.float16, mx.bfloat16, mx.float32)


def backend_module(name):
    return importlib.import_module(f"mlx_fastops.backends.{name}")


def select(op, backend, **info):
    """Return (fn, backend_used, reason) for `op` on `backend`.

    A GPU backend may lack the op or refuse the static shape class `info` (its function
    `unsupported_<op>(**info)` returns a reason); the reference implementation is used then, and
    `reason` says why, for the patch report.
    """
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; ops are {OPS}")
    if backend != "reference":
        mod = backend_module(backend)
        fn = getattr(mod, op, None)
        if fn is None:
            reason = f"no {backend} kernel for {op}"
        else:
            check = getattr(mod, f"unsupported_{op}", None)
            reason = check(**info) if check is not None else None
            if reason is None:
                return fn, backend, None
    else:
        reason = None
    return getattr(backend_module("reference"), op), "reference", reason


DECODE_ROWS = 8   # activation rows (B * L) of the GPU backends' decode kernels
PREFILL_OPS = ("qkv_proj", "gate_up_silu", "linear", "lm_head")   # their 9+ row paths: the `prefill` switch


def decode_rows_only(fn, op, stock=None):
    """`fn` (a GPU backend's op in PREFILL_OPS) for calls of up to DECODE_ROWS rows, and where
    `stock` = (lo, hi) is given, of rows outside lo < rows <= hi; the other calls (prefill) run the
    reference op: what the `prefill` switch leaves when it is off (stock=None), or where the tuner
    found the backend's prefill path no faster (tuner.stock_rows)."""
    ref = getattr(backend_module("reference"), op)
    lo, hi = (DECODE_ROWS, float("inf")) if stock is None else (max(stock[0], DECODE_ROWS), stock[1])

    def call(x, w):
        rows = x.size // x.shape[-1]
        return ref(x, w) if lo < rows <= hi else fn(x, w)
    return call


def _check_activation(x, name="x"):
    if not isinstance(x, mx.array):
        raise TypeError(f"{name} must be an mx.array, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16 or float32, got {x.dtype}")


def _check_linear(x, w):
    _check_activation(x)
    if not isinstance(w, PackedLinear):
        raise TypeError(f"weights must be a PackedLinear, got {type(w).__name__}")
    if x.shape[-1] != w.in_features:
        raise ValueError(f"x has {x.shape[-1]} features, the weights expect {w.in_features}")


def _run(op, args, info, backend):
    fn, _, _ = select(op, backend or backend_name(), **info)
    return fn(*args)


def qkv_proj(x, w, backend=None):
    _check_linear(x, w)
    if len(w.splits) != 3:
        raise ValueError(f"qkv_proj needs 3 output segments, the weights have {len(w.splits)}")
    return _run("qkv_proj", (x, w), w.info(), backend)


def gate_up_silu(x, w, backend=None):
    _check_linear(x, w)
    if len(w.splits) != 2 or w.splits[0] != w.splits[1]:
        raise ValueError(f"gate_up_silu needs 2 equal output segments, got {w.splits}")
    return _run("gate_up_silu", (x, w), w.info(), backend)


def lm_head(x, w, backend=None):
    _check_linear(x, w)
    return _run("lm_head", (x, w), w.info(), backend)


def linear(x, w, backend=None):
    _check_linear(x, w)
    return _run("linear", (x, w), w.info(), backend)


def rms_norm_residual(x, residual, weight, eps, backend=None):
    _check_activation(x)
    _check_activation(residual, "residual")
    if x.shape != residual.shape:
        raise ValueError(f"x {x.shape} and residual {residual.shape} differ in shape")
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"norm weight {weight.shape} does not match hidden size {x.shape[-1]}")
    info = {"hidden": x.shape[-1], "dtype": x.dtype}
    return _run("rms_norm_residual", (x, residual, weight, eps), info, backend)


def qk_norm_rope(q, k, q_norm, k_norm, eps, rope, offset, backend=None):
    _check_activation(q, "q")
    _check_activation(k, "k")
    if q.ndim != 4 or k.ndim != 4 or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q {q.shape} and k {k.shape} must be [B, L, heads, head_dim]")
    if not isinstance(rope, RopeSpec):
        raise TypeError(f"rope must be a RopeSpec, got {type(rope).__name__}")
    for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
        if w is not None and w.shape != (q.shape[-1],):
            raise ValueError(f"{name} weight {w.shape} does not match head_dim {q.shape[-1]}")
    info = {"head_dim": q.shape[-1], "dtype": q.dtype, "rope": rope, "norm": q_norm is not None}
    return _run("qk_norm_rope", (q, k, q_norm, k_norm, eps, rope, offset), info, backend)


def _check_attention(q, k, v):
    for name, a in (("q", q), ("k", k), ("v", v)):
        _check_activation(a, name)
        if a.ndim != 4:
            raise ValueError(f"{name} must be [B, heads, tokens, head_dim], got {a.shape}")
    if k.shape != v.shape or q.shape[-1] != k.shape[-1] or q.shape[0] != k.shape[0]:
        raise ValueError(f"q {q.shape}, k {k.shape}, v {v.shape} do not fit together")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} kv heads")


def decode_attention(q, k_cache, v_cache, length, scale, backend=None):
    _check_attention(q, k_cache, v_cache)
    if q.shape[2] != 1:
        raise ValueError(f"decode_attention takes one query token, got {q.shape[2]}")
    if not 0 < int(length) <= k_cache.shape[2]:
        raise ValueError(f"length {int(length)} outside the cache's {k_cache.shape[2]} slots")
    info = {"head_dim": q.shape[-1], "gqa": q.shape[1] // k_cache.shape[1], "dtype": q.dtype}
    return _run("decode_attention", (q, k_cache, v_cache, length, scale), info, backend)


def flash_attention(q, k, v, scale, mask=None, backend=None):
    _check_attention(q, k, v)
    if not (mask is None or isinstance(mask, (str, mx.array))):
        raise TypeError(f"mask must be None, 'causal' or an mx.array, got {type(mask).__name__}")
    if isinstance(mask, str) and mask != "causal":
        raise ValueError(f"mask string must be 'causal', got {mask!r}")
    info = {"head_dim": q.shape[-1], "gqa": q.shape[1] // k.shape[1], "dtype": q.dtype,
            "mask": "array" if isinstance(mask, mx.array) else mask}
    return _run("flash_attention", (q, k, v, scale, mask), info, backend)


def quantized_attention(q, q_keys, q_values, scale, mask=None, group_size=64, bits=8, backend=None):
    _check_activation(q, "q")
    if not (isinstance(q_keys, tuple) and isinstance(q_values, tuple) and len(q_keys) == len(q_values) == 3):
        raise TypeError("q_keys and q_values must be (packed uint32, scales, biases) tuples")
    if q_keys[0].dtype != mx.uint32 or q_keys[0].shape[-1] * 32 // bits != q.shape[-1]:
        raise ValueError(f"packed keys {q_keys[0].shape} {q_keys[0].dtype} do not hold head_dim "
                         f"{q.shape[-1]} at {bits} bits")
    if q.shape[1] % q_keys[0].shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {q_keys[0].shape[1]} kv heads")
    info = {"head_dim": q.shape[-1], "gqa": q.shape[1] // q_keys[0].shape[1], "dtype": q.dtype,
            "mask": "array" if isinstance(mask, mx.array) else mask, "bits": bits,
            "group_size": group_size}
    return _run("quantized_attention", (q, q_keys, q_values, scale, mask, group_size, bits), info, backend)
