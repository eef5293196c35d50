"""Fused replacements for mlx-lm's Attention, MLP and TransformerBlock, and the Watch that keeps
them in step with the model.

Each fused module holds the stock module's children, the same objects under the same names (so
`model.parameters()` keys do not change), and the op functions the patcher selected as plain
attributes (`*_fn`: what the profiler times). The patcher (mlx_fastops.patcher) sets those
attributes from the children, and sets them again when the children change.

A fused call runs the fused ops only while its `watch.fast` holds: nothing the fused state was
built from was written since, and the model was not put in training mode after patch. Otherwise
`watch.ready()` rebuilds the state from the model's current modules; where it cannot (training
mode; inside mx.compile / mx.vmap over changed arrays) the call computes the stock module's own
__call__ on the same children, so outputs and gradients are stock's.
"""

import copy
from functools import partial

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import sum_gradients
from mlx_lm.models.activations import swiglu
from mlx_lm.models.base import scaled_dot_product_attention as stock_sdpa
from mlx_lm.models.cache import KVCache

# What mx.eval raises inside mx.compile / mx.vmap: a rebuild there would keep traced arrays.
TRANSFORM_ERROR = "during function transformations"


class Watch:
    """Whether one patch's fused state may run (`fast`).

    Every item write into a module the state was built from calls changed(): the fused modules'
    own (children replaced: nn.quantize, LoRA, update_modules) and, through `watched_class`, the
    array-holding modules' (load_weights, update, set_dtype, assignment, value_and_grad). So does
    a change of training mode: mx.compile(outputs=model.state), as mlx-lm's trainer runs, writes
    arrays back without an item write. `rebuild(force)` (mlx_fastops.state) compares the model
    with what the state was built from, by identity, and where anything differs (or if force)
    rebuilds the state from the current modules.
    """

    def __init__(self, rebuild):
        self.fast = True
        self.training = False
        self.stale = False
        self.force = False
        self.rebuild = rebuild

    def changed(self):
        self.stale = True
        self.fast = False

    def set_training(self, mode):
        if mode != self.training:
            self.training = mode
            self.changed()

    def ready(self):
        """Bring the fused state up to date; False where the stock composition must run."""
        if self.training:
            return False
        if self.stale:
            try:
                self.rebuild(self.force)
            except ValueError as e:
                if TRANSFORM_ERROR not in str(e):
                    raise
                return False
            self.stale = self.force = False
        self.fast = True
        return True

    def __deepcopy__(self, memo):
        # A copy's arrays are new objects: its fused state (and a compiled step, which cannot be
        # copied) is rebuilt from them on first use.
        new = Watch.__new__(Watch)
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        new.force = True
        new.changed()
        return new


def _changed(module):
    watch = module.__dict__.get("_fastops_watch")
    if watch is not None:
        watch.changed()


_WATCHED = {}


def watched_class(base):
    """A subclass of `base` (same name) whose item writes and deletions tell the object's Watch
    (its `_fastops_watch`). The patcher swaps `__class__` on the model's array-holding modules and
    swaps it back on unpatch."""
    cls = _WATCHED.get(base)
    if cls is None:
        def __setitem__(self, key, value):
            _changed(self)
            base.__setitem__(self, key, value)

        def __delitem__(self, key):
            _changed(self)
            base.__delitem__(self, key)

        cls = _WATCHED[base] = type(base.__name__, (base,), {"__setitem__": __setitem__,
                                                             "__delitem__": __delitem__})
    return cls


def is_watched(cls):
    return cls in _WATCHED.values() or cls in _HEADS.values() or issubclass(cls, _Fused)


class _Fused(nn.Module):
    """The stock module's children and plain attributes, a Watch, and the stock call."""

    def __init__(self, stock, names, watch):
        super().__init__()
        # Flags such as Llama's `use_sliding`, `n_heads`, `scale`: whatever the stock code reads.
        for key, value in vars(stock).items():
            if (not key.startswith("_") or key == "_training") and key not in self:
                object.__setattr__(self, key, value)
        for key, value in stock.items():
            dict.__setitem__(self, key, value)
        object.__setattr__(self, "_stock", stock)
        object.__setattr__(self, "_names", names)
        object.__setattr__(self, "watch", watch)

    def __setitem__(self, key, value):
        self.watch.changed()
        super().__setitem__(key, value)

    def __delitem__(self, key):
        self.watch.changed()
        super().__delitem__(key)

    def _set_training_mode(self, mode):
        super()._set_training_mode(mode)
        self.watch.set_training(mode)

    def aliases(self):
        """Each present child under its role (`names` maps role -> attribute) as `_<role>`."""
        return {f"_{role}": self[attr] for role, attr in self._names.items() if attr in self}

    def stock_call(self, *args, **kwargs):
        return type(self._stock).__call__(self, *args, **kwargs)


def _delta(lora, x):
    """LoRALinear's low-rank term, exactly as its __call__ computes it."""
    z = (lora.dropout(x) @ lora.lora_a) @ lora.lora_b
    return (lora.scale * z).astype(x.dtype)


def _on_shards(op, w):
    """`op` over column shards (`w.group` set: a tensor-parallel model's q/k/v or gate/up) as
    mlx's AllToShardedLinear runs its matmul: on the input passed through sum_gradients (identity
    forward; its gradient all-summed over the group). Without a group, `op` itself."""
    if w.group is None:
        return op
    grad_sum = sum_gradients(w.group)
    return lambda x, w: op(grad_sum(x), w)


def _qkv_lora(x, op, w, adapters):
    return tuple(y if a is None else y + _delta(a, x) for y, a in zip(op(x, w), adapters))


def _gate_up_lora(x, proj, w, adapters):
    # SiLU comes after the deltas: the gate/up projection alone, then mlx-lm's swiglu.
    gate, up = (y if a is None else y + _delta(a, x)
                for y, a in zip(mx.split(proj(x, w), 2, axis=-1), adapters))
    return swiglu(gate, up)


class FusedAttention(_Fused):
    """Attention with Q/K/V in one op, q/k norm + RoPE in one op, and attention ops.

    x [B, L, hidden] -> [B, L, hidden]. settings() turns the ops selected by the patcher
    ("qkv", "norm_rope", "decode", "prefill", "quantized", "out": o_proj bound to its weights; a
    missing or None key runs that step as the stock module does) into the module's attributes.
    """

    def settings(self, ops, qkv_weights=None, rope=None, adapters=(None, None, None)):
        s = self.aliases()
        norm = "_q_norm" in s
        s.update(qkv_weights=qkv_weights, rope_spec=rope, adapters=tuple(adapters), has_qk_norm=norm,
                 decode_fn=ops.get("decode"), prefill_fn=ops.get("prefill"),
                 quantized_fn=ops.get("quantized"), out_fn=ops.get("out"), qkv_fn=None,
                 norm_rope_fn=None)
        if "qkv" in ops:
            op = _on_shards(ops["qkv"], qkv_weights)
            s["qkv_fn"] = (partial(_qkv_lora, op=op, w=qkv_weights, adapters=tuple(adapters))
                           if any(a is not None for a in adapters) else partial(op, w=qkv_weights))
        if "norm_rope" in ops:
            qn, kn = (s["_q_norm"].weight, s["_k_norm"].weight) if norm else (None, None)
            s["norm_rope_fn"] = partial(ops["norm_rope"], q_norm=qn, k_norm=kn,
                                        eps=s["_q_norm"].eps if norm else 0.0, rope=rope)
        return s

    def _stock_norm_rope(self, q, k, offset):
        if self.has_qk_norm:
            q, k = self._q_norm(q), self._k_norm(k)
        q = self._rope(q.transpose(0, 2, 1, 3), offset=offset)
        k = self._rope(k.transpose(0, 2, 1, 3), offset=offset)
        return q, k

    def __call__(self, x, mask=None, cache=None):
        w = self.watch
        if not (w.fast or w.ready()):
            return self.stock_call(x, mask, cache)
        B, L, _ = x.shape
        qkv, norm_rope = self.qkv_fn, self.norm_rope_fn or self._stock_norm_rope
        q, k, v = qkv(x) if qkv is not None else (self._q(x), self._k(x), self._v(x))
        q = q.reshape(B, L, self.n_heads, -1)
        k = k.reshape(B, L, self.n_kv_heads, -1)
        v = v.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        if cache is None:
            q, k = norm_rope(q, k, offset=0)
        else:
            q, k = norm_rope(q, k, offset=cache.offset)
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
        return (self.out_fn or self._o)(o.transpose(0, 2, 1, 3).reshape(B, L, -1))


class FusedMLP(_Fused):
    """down(silu(gate(x)) * up(x)) with gate/up as one op.  x [B, L, hidden] -> [B, L, hidden].

    With LoRA adapters on gate/up, `proj_fn` is the stacked projection alone (SiLU must follow the
    deltas); without a fused op the stock module's call runs."""

    def settings(self, gate_up_fn=None, weights=None, adapters=(None, None), down_fn=None):
        s = self.aliases()
        s.update(gate_up_weights=weights, adapters=tuple(adapters), gate_up_fn=None, down_fn=down_fn)
        if gate_up_fn is not None:
            op = _on_shards(gate_up_fn, weights)
            s["gate_up_fn"] = (partial(_gate_up_lora, proj=op, w=weights, adapters=tuple(adapters))
                               if any(a is not None for a in adapters) else partial(op, w=weights))
        return s

    def __call__(self, x):
        w = self.watch
        if (w.fast or w.ready()) and self.gate_up_fn is not None:
            return (self.down_fn or self._down)(self.gate_up_fn(x))
        return self.stock_call(x)


class FusedBlock(_Fused):
    """Pre-norm decoder block; the residual add and the post-attention RMSNorm are one op.

    For a backend's whole-block decode path (DecodePath.block reads it): `watch` (see Watch), the
    children under their roles (`_attention`, `_mlp`, `_input_norm`, `_post_norm`), the attention's
    `qkv_weights`, `rope_spec`, `adapters`, the MLP's `gate_up_weights`, `adapters`."""

    def settings(self, add_norm_fn=None):
        s = self.aliases()
        norm = s["_post_norm"]
        s["add_norm_fn"] = partial(add_norm_fn, weight=norm.weight, eps=norm.eps) if add_norm_fn else None
        # A backend's whole-block decode path (set by the patcher): fast_fn(x, cache) -> out or
        # None, taken only for caches of the types fast_fn.cache_types and no array mask.
        s["fast_fn"] = None
        return s

    def __call__(self, x, mask=None, cache=None):
        w = self.watch
        if not (w.fast or w.ready()):
            return self.stock_call(x, mask, cache)
        fast = self.fast_fn
        if fast is not None and type(cache) in fast.cache_types and not isinstance(mask, mx.array):
            out = fast(x, cache)
            if out is not None:
                return out
        r = self._attention(self._input_norm(x), mask, cache)
        if self.add_norm_fn is None:
            h = x + r
            return h + self._mlp(self._post_norm(h))
        h, n = self.add_norm_fn(r, x)
        return h + self._mlp(n)


_HEADS = {}


def head_class(base):
    """A watched subclass of the stock embedding / lm_head class whose output projection is our op.

    The patcher swaps `__class__` on the stock object (its parameters stay where they are) and
    sets `_fastops_head_fn` and `_fastops_watch`; unpatch swaps the class back. While the Watch
    is not fast (and cannot be made so), or after a rebuild left the head stock, base's own
    projection runs."""
    cls = _HEADS.get(base)
    if cls is None:
        method = "as_linear" if issubclass(base, (nn.Embedding, nn.QuantizedEmbedding)) else "__call__"
        stock = getattr(base, method)

        def project(self, x):
            w = self._fastops_watch
            if w.fast or w.ready():
                fn = self.__dict__.get("_fastops_head_fn")
                if fn is not None:
                    return fn(x)
            return stock(self, x)

        cls = _HEADS[base] = type(f"Fused{base.__name__}", (watched_class(base),), {method: project})
    return cls
