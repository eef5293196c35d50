"""What the tuner times: each per-op fusion's op against the stock ops it replaces, on one
patched block's own modules and weights (the first fused decoder block and the head), at the
tuning shapes: decode rows (batch B, one token each) and prefill chunks (P tokens).

A Probe's `fused` and `stock` take the same fresh random inputs (`make()`) and return arrays;
the stock side is what the model computes with that fusion off:
  qkv            qkv_fn(x)                        q_proj(x), k_proj(x), v_proj(x)    decode rows
  gate_up        gate_up_fn(x)                    swiglu(gate_proj(x), up_proj(x))   decode rows
  lm_head        the head op                      the stock class's projection       decode rows
  qk_norm_rope   norm_rope_fn(q, k, offset)       q/k RMSNorm, then nn.RoPE          decode rows, prefill
  residual_norm  add_norm_fn(r, x)                x + r, then the post-attention norm decode rows, prefill
  attention      decode_fn over a KV buffer;      mx.fast.scaled_dot_product_attention  decode rows at the
                 prefill_fn, causal               on the valid part / causal         context length, prefill
qkv and gate_up at more than 8 rows run the backend's prefill path (CUDA: 9-64 rows the tensor-core
qmm, 512 or more the dense path) or the reference op (stock's own quantized_matmul on the stacked
weights), so they are timed at decode rows; `prefill` (those calls, and o_proj / down, on a GPU's
prefill path) is timed by whole prompt chunks (tuner._whole_prefill; 64 tokens for qmm),
since its cost is also in what stays alive between the calls (backends/cuda/prefill.py).
"""

import itertools
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
from mlx_lm.models.activations import swiglu
from mlx_lm.models.base import scaled_dot_product_attention as stock_sdpa

from .ops.weights import out_features

KV_STEP = 256   # mlx-lm's KVCache grows its buffers in steps of 256 tokens


@dataclass
class Probe:
    fusion: str
    shape: str                 # e.g. "decode B=4", "prefill 512"
    make: Callable             # () -> tuple of inputs
    fused: Callable            # (*inputs) -> array or tuple of arrays
    stock: Callable


_KEYS = itertools.count()


def _randn(*shape, dtype):
    # Keyed: tuning must not move the user's global random state (sampling after patch()).
    return lambda: mx.random.normal(shape, key=mx.random.key(next(_KEYS))).astype(dtype)


def _inputs(*makers):
    return lambda: tuple(m() for m in makers)


def probes(state, rows, prefill, context):
    """The probes of a patched model's PatchState (its first fused block and head)."""
    block = next(b for b in state.text.model.layers if state.owns(b))
    names = state.recipe["block"]
    attn, mlp = block[names["attention"]], block[names["mlp"]]
    dtype = state.text.model.embed_tokens(mx.array([[0]])).dtype
    hidden = block._post_norm.weight.shape[0]
    H, Hkv = attn.n_heads, attn.n_kv_heads
    out = []
    x = lambda b, n: _inputs(_randn(b, n, hidden, dtype=dtype))
    for b in rows:
        if attn.qkv_fn is not None:
            out.append(Probe("qkv", f"decode B={b}", x(b, 1), attn.qkv_fn,
                             lambda x: (attn._q(x), attn._k(x), attn._v(x))))
        if mlp.gate_up_fn is not None:
            out.append(Probe("gate_up", f"decode B={b}", x(b, 1), mlp.gate_up_fn,
                             lambda x: swiglu(mlp._gate(x), mlp._up(x))))
        if state.head is not None:
            obj, original, head = state.head
            project = original.as_linear if hasattr(original, "as_linear") else original.__call__
            out.append(Probe("lm_head", f"decode B={b}", x(b, 1), head, lambda x: project(obj, x)))
    # (batch, tokens, the RoPE offset / attention length, label) of each shape
    shapes = [(b, 1, context, f"decode B={b}") for b in rows] + [(1, p, 0, f"prefill {p}") for p in prefill]
    head_dim = out_features(attn._q) // H
    for b, n, offset, label in shapes:
        if attn.norm_rope_fn is not None:
            qk = _inputs(_randn(b, n, H, head_dim, dtype=dtype), _randn(b, n, Hkv, head_dim, dtype=dtype))
            out.append(Probe("qk_norm_rope", label, qk, lambda q, k, o=offset: attn.norm_rope_fn(q, k, offset=o),
                             lambda q, k, o=offset: attn._stock_norm_rope(q, k, o)))
        if block.add_norm_fn is not None:
            rx = _inputs(_randn(b, n, hidden, dtype=dtype), _randn(b, n, hidden, dtype=dtype))
            out.append(Probe("residual_norm", label, rx, block.add_norm_fn, lambda r, x: _add_norm(block, r, x)))
    out += _attention(attn, rows, prefill, context, dtype, head_dim)
    return out


def _add_norm(block, r, x):
    h = x + r
    return h, block._post_norm(h)


def _attention(attn, rows, prefill, context, dtype, D):
    H, Hkv, scale = attn.n_heads, attn.n_kv_heads, attn.scale
    out = []
    if attn.decode_fn is not None:
        cap = -(-context // KV_STEP) * KV_STEP
        for b in rows:
            qkv = _inputs(_randn(b, H, 1, D, dtype=dtype), _randn(b, Hkv, cap, D, dtype=dtype),
                          _randn(b, Hkv, cap, D, dtype=dtype))
            out.append(Probe("attention", f"decode B={b} @{context}", qkv,
                             lambda q, k, v: attn.decode_fn(q, k, v, context, scale),
                             lambda q, k, v: stock_sdpa(q, k[:, :, :context], v[:, :, :context], cache=None,
                                                        scale=scale, mask=None)))
    if attn.prefill_fn is not None:
        for p in prefill:
            qkv = _inputs(_randn(1, H, p, D, dtype=dtype), _randn(1, Hkv, p, D, dtype=dtype),
                          _randn(1, Hkv, p, D, dtype=dtype))
            out.append(Probe("attention", f"prefill {p}", qkv,
                             lambda q, k, v: attn.prefill_fn(q, k, v, scale, "causal"),
                             lambda q, k, v: stock_sdpa(q, k, v, cache=None, scale=scale, mask="causal")))
    return out
