"""Fused replacements for mlx-lm's Attention, MLP and TransformerBlock.

Each fused module keeps the stock submodules under their stock names (so `model.parameters()`
keys do not change) and holds the selected op functions as plain attributes, chosen once at patch
time. Attributes named `*_fn` are the ops the profiler times.
"""

from functools import partial

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import scaled_dot_product_attention as stock_sdpa
from mlx_lm.models.cache import KVCache


def _copy_plain_attributes(dst, src):
    # Flags such as Llama's `use_sliding`, `n_heads`, `scale`, `args`: whatever the stock model reads.
    for key, value in vars(src).items():
        if not key.startswith("_") and key not in dst:
            object.__setattr__(dst, key, value)


def _adopt_children(dst, stock, names, replace=None):
    """Keep the stock children under their stock names (same parameter keys) and alias each
    under its role (`names` maps role -> attribute, from the family's recipe) as `_<role>`."""
    for role, attr in names.items():
        child = (replace or {}).get(role, stock[attr])
        setattr(dst, attr, child)
        object.__setattr__(dst, f"_{role}", child)


class FusedAttention(nn.Module):
    """Attention with Q/K/V in one op, q/k norm + RoPE in one op, and attention ops.

    x [B, L, hidden] -> [B, L, hidden]. `ops` maps "qkv", "norm_rope", "decode", "prefill" to the
    functions selected at patch time; a missing key runs that step as the stock module does.
    """

    def __init__(self, stock, names, ops, qkv_weights=None, rope=None):
        super().__init__()
        _copy_plain_attributes(self, stock)
        _adopt_children(self, stock, names)
        # Kept for backend fast paths (plain attributes, not parameters).
        object.__setattr__(self, "qkv_weights", qkv_weights)
        object.__setattr__(self, "rope_spec", rope)
        self.qkv_fn = partial(ops["qkv"], w=qkv_weights) if "qkv" in ops else self._stock_qkv
        self.has_qk_norm = "q_norm" in names
        if "norm_rope" in ops:
            qn = self._q_norm.weight if self.has_qk_norm else None
            kn = self._k_norm.weight if self.has_qk_norm else None
            eps = self._q_norm.eps if self.has_qk_norm else 0.0
            self.norm_rope_fn = partial(ops["norm_rope"], q_norm=qn, k_norm=kn, eps=eps, rope=rope)
        else:
            self.norm_rope_fn = self._stock_norm_rope
        self.decode_fn = ops.get("decode")
        self.prefill_fn = ops.get("prefill")
        self.quantized_fn = ops.get("quantized")

    def _stock_qkv(self, x):
        return self._q(x), self._k(x), self._v(x)

    def _stock_norm_rope(self, q, k, offset):
        if self.has_qk_norm:
            q, k = self._q_norm(q), self._k_norm(k)
        q = self._rope(q.transpose(0, 2, 1, 3), offset=offset)
        k = self._rope(k.transpose(0, 2, 1, 3), offset=offset)
        return q, k

    def __call__(self, x, mask=None, cache=None):
        B, L, _ = x.shape
        q, k, v = self.qkv_fn(x)
        q = q.reshape(B, L, self.n_heads, -1)
        k = k.reshape(B, L, self.n_kv_heads, -1)
        v = v.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        if cache is None:
            q, k = self.norm_rope_fn(q, k, offset=0)
        else:
            q, k = self.norm_rope_fn(q, k, offset=cache.offset)
            k, v = cache.update_and_fetch(k, v)
        if self.decode_fn is not None and L == 1 and mask is None and type(cache) is KVCache:
            # The cache's full buffers and the valid length: no strided-view copy for kernels.
            o = self.decode_fn(q, cache.keys, cache.values, cache.offset, self.scale)
        elif hasattr(cache, "bits"):
            if self.quantized_fn is not None and not isinstance(mask, mx.array):
                o = self.quantized_fn(q, k, v, self.scale, mask, cache.group_size, cache.bits)
            else:
                o = stock_sdpa(q, k, v, cache=cache, scale=self.scale, mask=mask)
        elif self.prefill_fn is not None and not isinstance(mask, mx.array):
            o = self.prefill_fn(q, k, v, self.scale, mask)
        else:
            o = stock_sdpa(q, k, v, cache=cache, scale=self.scale, mask=mask)
        return self._o(o.transpose(0, 2, 1, 3).reshape(B, L, -1))


class FusedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate/up as one op.  x [B, L, hidden] -> [B, L, hidden]."""

    def __init__(self, stock, names, gate_up_fn, weights):
        super().__init__()
        _copy_plain_attributes(self, stock)
        _adopt_children(self, stock, names)
        object.__setattr__(self, "gate_up_weights", weights)
        self.gate_up_fn = partial(gate_up_fn, w=weights)

    def __call__(self, x):
        return self._down(self.gate_up_fn(x))


class FusedBlock(nn.Module):
    """Pre-norm decoder block; the residual add and the post-attention RMSNorm are one op."""

    def __init__(self, stock, names, children, add_norm_fn):
        super().__init__()
        _copy_plain_attributes(self, stock)
        _adopt_children(self, stock, names, replace=children)
        norm = self._post_norm
        self.add_norm_fn = partial(add_norm_fn, weight=norm.weight, eps=norm.eps) if add_norm_fn else None
        # A backend's whole-block decode path (set by the patcher): fast_fn(x, cache) -> out or
        # None, taken only for caches of type fast_fn.cache_type and no array mask.
        object.__setattr__(self, "fast_fn", None)

    def __call__(self, x, mask=None, cache=None):
        fast = self.fast_fn
        if fast is not None and type(cache) is fast.cache_type and not isinstance(mask, mx.array):
            out = fast(x, cache)
            if out is not None:
                return out
        r = self._attention(self._input_norm(x), mask, cache)
        if self.add_norm_fn is None:
            h = x + r
            return h + self._mlp(self._post_norm(h))
        h, n = self.add_norm_fn(r, x)
        return h + self._mlp(n)


def head_class(base):
    """A subclass of the stock embedding / lm_head class whose output projection is our op.

    The patcher swaps `__class__` on the stock object (its parameters stay where they are) and
    sets `_fastops_head_fn`; unpatch swaps the class back.
    """
    cls = _HEAD_CLASSES.get(base)
    if cls is None:
        if issubclass(base, (nn.Embedding, nn.QuantizedEmbedding)):
            body = {"as_linear": lambda self, x: self._fastops_head_fn(x)}
        else:
            body = {"__call__": lambda self, x: self._fastops_head_fn(x)}
        cls = _HEAD_CLASSES[base] = type(f"Fused{base.__name__}", (base,), body)
    return cls


_HEAD_CLASSES = {}
