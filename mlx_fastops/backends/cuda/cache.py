"""The KV caches of the fast decode path, written in place by its kernels: StaticKVCache (mlx-lm's
KVCache, one sequence per row, one offset), StaticQuantizedKVCache (mlx-lm's QuantizedKVCache, what
StaticKVCache.to_quantized makes: generate_step's kv_bits) and StaticBatchKVCache (mlx-lm's
BatchKVCache: rows left-padded, finishing and joining as mlx-lm's BatchGenerator batches them)."""

import mlx.core as mx
from mlx_lm.models import cache as _mlx_lm_cache
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache

from .quantized_kv import KV_BITS, KV_GROUPS
from .source import MAX_ROWS, PAD_WORDS


class _WrittenInPlace:
    """The ordering discipline of a cache whose buffers the fast decode kernels write in place.

    MLX does not see those in-place writes, and MLX's CUDA graphs order kernels only by the
    buffers they declare (a kernel waits for the last kernel that output one of its input
    buffers). So the order is made explicit: `last_reader` is an output of the latest fast-path
    launches over the buffers (the layer launch's attention output; in FastBlock.wide the block's
    output, after its every kernel); the next fast-path writer (the QKV epilogue) takes it as an
    extra input, and stock code that touches the buffers evaluates it first (`_ordered`). Without this,
    steps built lazily whose inputs do not depend on each other (teacher forcing) could run out of
    order in one graph.
    """

    last_reader = None

    def _ordered(self):
        """Finish the fast path's pending kernels before stock ops read or write the buffers."""
        if self.last_reader is not None:
            mx.eval(self.last_reader)
            self.last_reader = None

    def fast_inputs(self):
        """(keys, values, after) for the fast path's in-place writer; `after` is the last reader
        (the writer's kernel takes it as an input, so it waits for it), else the keys again."""
        return self.keys, self.values, self.keys if self.last_reader is None else self.last_reader

    def position(self):
        """Where the fast path writes the next token (every row)."""
        return self.offset

    def advance(self, L, reader):
        """After the fast path wrote L tokens: `reader` is the new last reader."""
        self.offset += L
        self.last_reader = reader

    def _slots_for(self, keys):
        """Room for keys' [B, n_kv, L, D] new positions at `offset`, with the fast path's pending
        writes done, counted in: -> (their first position, end)."""
        B, n_kv, L, D = keys.shape
        prev = self.offset
        self.reserve(B, n_kv, D, keys.dtype, prev + L)
        self._ordered()
        self.offset = prev + L
        return prev, prev + L


def _ordered_state(base):
    """base's `state` property (save_prompt_cache and mlx-lm's prefill read it), after the fast
    path's pending writes."""

    def get(self):
        self._ordered()
        return base.state.fget(self)

    def put(self, v):
        self._ordered()
        base.state.fset(self, v)

    return property(get, put)


class StaticKVCache(_WrittenInPlace, KVCache):
    """KVCache whose buffers grow in big steps and are written in place by the fast decode path.

    Prefill (and every path that is not the fast path) writes through `update_and_fetch` exactly
    like KVCache (slice assignment, in place when MLX can donate); the fast decode kernels write
    the new k/v rows straight into `keys`/`values` at `offset`.
    """

    step = 1024

    def takes(self, B, n_kv, D, dtype):
        """Whether the fast path can decode B rows over this cache (reserve adapts the buffers)."""
        return True

    def reserve(self, B, n_kv, D, dtype, needed):
        k = self.keys
        if k is not None and k.shape[2] >= needed and k.shape[0] == B and k.shape[1] == n_kv \
                and k.shape[3] == D and k.dtype == dtype:
            return
        self._ordered()
        S = -(-needed // self.step) * self.step
        nk = mx.zeros((B, n_kv, S, D), dtype=dtype)
        nv = mx.zeros((B, n_kv, S, D), dtype=dtype)
        if self.keys is not None and self.offset > 0:
            nk[..., : self.offset, :] = self.keys[..., : self.offset, :]
            nv[..., : self.offset, :] = self.values[..., : self.offset, :]
        self.keys, self.values = nk, nv

    def update_and_fetch(self, keys, values):
        prev, end = self._slots_for(keys)
        self.keys[..., prev:end, :] = keys
        self.values[..., prev:end, :] = values
        return self.keys[..., :end, :], self.values[..., :end, :]

    state = _ordered_state(KVCache)

    def to_quantized(self, group_size=64, bits=4):
        """mlx-lm's conversion to a QuantizedKVCache (generate_step's kv_bits), of the buffers as
        the fast path's pending in-place writes leave them: a StaticQuantizedKVCache where the fast
        path takes the format, else mlx-lm's own class."""
        self._ordered()
        if bits not in KV_BITS or group_size not in KV_GROUPS:
            return super().to_quantized(group_size=group_size, bits=bits)
        q = StaticQuantizedKVCache(group_size=group_size, bits=bits)
        q.offset = self.offset
        if self.keys is not None:
            q.keys = mx.quantize(self.keys, group_size=group_size, bits=bits)
            q.values = mx.quantize(self.values, group_size=group_size, bits=bits)
        return q

    @classmethod
    def merge(cls, caches):
        # mlx-lm's BatchGenerator batches the model's caches through this: a batch the fast path takes
        return StaticBatchKVCache.merge(caches)


class StaticQuantizedKVCache(_WrittenInPlace, QuantizedKVCache):
    """QuantizedKVCache whose buffers grow in big steps and are written in place by the fast decode
    path: keys and values are each (packed uint32 [B, Hkv, S, D * bits / 32], scales, biases
    [B, Hkv, S, D / group_size]); the fast path's QKV epilogue quantises each new k/v row as
    mx.quantize does on this backend, at `offset`. Prefill and every other path write through
    `update_and_fetch` as QuantizedKVCache does (mx.quantize, slice assignment)."""

    step = StaticKVCache.step

    def takes(self, B, n_kv, D, dtype):
        """Whether the one-launch layer can decode B rows over this cache (4/8 bits, groups of
        32/64/128 that tile D; batches of at most MAX_ROWS rows: FastBlock.wide has no quantised
        cache)."""
        if B > MAX_ROWS or self.bits not in KV_BITS or self.group_size not in KV_GROUPS or D % self.group_size:
            return False
        k = self.keys
        return k is None or (k[0].shape[:2] == (B, n_kv) and k[0].shape[3] * 32 == D * self.bits
                             and k[1].dtype == dtype and self.values[0].shape == k[0].shape)

    def reserve(self, B, n_kv, D, dtype, needed):
        """Buffers of at least `needed` positions for B rows of n_kv heads of D values (new ones,
        holding the positions so far, where the present ones differ in any of these)."""
        k = self.keys
        if k is not None and k[0].shape[2] >= needed and k[0].shape[:2] == (B, n_kv) \
                and k[0].shape[3] * 32 == D * self.bits and k[1].dtype == dtype:
            return
        self._ordered()
        S = -(-needed // self.step) * self.step
        widths = (D * self.bits // 32, D // self.group_size, D // self.group_size)

        def grown(old):
            new = tuple(mx.zeros((B, n_kv, S, w), t) for w, t in zip(widths, (mx.uint32, dtype, dtype)))
            if old is not None and self.offset > 0:
                for n, o in zip(new, old):
                    n[..., : self.offset, :] = o[..., : self.offset, :]
            return new

        self.keys, self.values = grown(self.keys), grown(self.values)

    def fast_inputs(self):
        """(k_w, k_s, k_b, v_w, v_s, v_b, after): see _WrittenInPlace.fast_inputs (`after` is an
        array of the activation dtype: the key scales where there is no last reader)."""
        after = self.keys[1] if self.last_reader is None else self.last_reader
        return (*self.keys, *self.values, after)

    def update_and_fetch(self, keys, values):
        prev, end = self._slots_for(keys)
        for buf, new in ((self.keys, keys), (self.values, values)):
            for b, q in zip(buf, mx.quantize(new, group_size=self.group_size, bits=self.bits)):
                b[..., prev:end, :] = q
        return self.keys_and_values()

    def keys_and_values(self):
        self._ordered()
        return tuple(tuple(a[..., : self.offset, :] for a in t) for t in (self.keys, self.values))

    state = _ordered_state(QuantizedKVCache)


class StaticBatchKVCache(_WrittenInPlace, BatchKVCache):
    """mlx-lm's BatchKVCache (rows left-padded; one write index `_idx` shared by every row; per-row
    `offset` = `_idx` - `left_padding`, which every BatchKVCache method keeps) whose buffers the
    fast decode path writes in place at `_idx`: RoPE at row b's offset, attention over
    [left_padding[b], _idx].

    Every method is BatchKVCache's (BatchGenerator's prefill with right padding, merge, extend,
    filter, extract, finalize, trim); those that read or write the buffers first finish the fast
    path's pending kernels. The fast path adds its tokens to the per-row offsets as a number, which
    `offset` folds in when read: no graph node per layer and step that nothing evaluates.
    """

    _pending = 0   # tokens the fast path added to every row's offset since `offset` was last read
    _lp_words = None

    @property
    def offset(self):
        if self._pending:
            self._offset, self._pending = self._offset + self._pending, 0
        return self._offset

    @offset.setter
    def offset(self, value):
        self._offset, self._pending = value, 0

    @property
    def left_padding(self):
        return self._left_padding

    @left_padding.setter
    def left_padding(self, value):
        # every change (mlx-lm's `+=` changes the array in place, then assigns it) drops the
        # kernels' copy
        self._left_padding, self._lp_words = value, None

    def position(self):
        return self._idx

    def takes(self, B, n_kv, D, dtype):
        # Right padding (a prompt chunk before finalize) and other row counts take stock's path.
        k = self.keys
        return (self._right_padding is None and self.left_padding.shape[0] == B
                and (k is None or (k.shape[0] == B and k.shape[1] == n_kv and k.shape[3] == D and k.dtype == dtype)))

    def reserve(self, B, n_kv, D, dtype, needed):
        """Buffers holding `needed` positions, grown as BatchKVCache.update_and_fetch grows them."""
        if self.keys is not None and self.keys.shape[2] >= needed:
            return
        self._ordered()
        prev = self._idx
        S = -(-(needed - prev) // self.step) * self.step
        nk, nv = mx.zeros((B, n_kv, S, D), dtype), mx.zeros((B, n_kv, S, D), dtype)
        if self.keys is None:
            self.keys, self.values = nk, nv
            return
        if prev % self.step != 0:
            self.keys, self.values = self.keys[..., :prev, :], self.values[..., :prev, :]
        self.keys = mx.concatenate([self.keys, nk], axis=2)
        self.values = mx.concatenate([self.values, nv], axis=2)

    def fast_inputs(self):
        """(keys, values, after, left padding as the kernels take it: int32[max(B, PAD_WORDS)], made
        on the GPU once per change: a host-made or 8-byte array would fault, see source.OFF_WORDS);
        see _WrittenInPlace.fast_inputs."""
        if self._lp_words is None:
            lp = self._left_padding.astype(mx.int32)
            self._lp_words = mx.pad(lp, (0, PAD_WORDS - lp.shape[0])) if lp.shape[0] < PAD_WORDS else lp + 0
        return (*super().fast_inputs(), self._lp_words)

    def advance(self, L, reader):
        self._idx += L
        self._pending += L
        self.last_reader = reader

    def update_and_fetch(self, keys, values):
        self._ordered()
        return super().update_and_fetch(keys, values)

    def keys_and_values(self):
        self._ordered()
        return super().keys_and_values()

    @property
    def state(self):
        self._ordered()
        return self.keys, self.values, self.offset, self.left_padding, self._idx

    @state.setter
    def state(self, v):
        self._ordered()
        self.keys, self.values, self.offset, self.left_padding, self._idx = v

    def finalize(self):
        self._ordered()
        super().finalize()

    def filter(self, batch_indices):
        self._ordered()
        super().filter(batch_indices)

    def extend(self, other):
        self._ordered()
        if isinstance(other, _WrittenInPlace):
            other._ordered()
        super().extend(other)

    def extract(self, idx):
        """Row idx as the fast path's single-sequence cache (BatchKVCache.extract's KVCache)."""
        self._ordered()
        c = super().extract(idx)
        one = StaticKVCache()
        one.keys, one.values, one.offset = c.keys, c.values, c.offset
        return one

    @classmethod
    def merge(cls, caches):
        for c in caches:
            if isinstance(c, _WrittenInPlace):
                c._ordered()
        merged = super().merge(caches)
        # mlx-lm makes a merge of empty caches a BatchKVCache of its own class
        return merged if type(merged) is cls else cls([0] * len(caches))


# mlx-lm's load_prompt_cache finds cache classes by name in its own module: let it find ours, so a
# prompt cache saved from a patched model (mlx_lm.cache_prompt, save_prompt_cache) loads again.
_mlx_lm_cache.StaticKVCache = StaticKVCache
_mlx_lm_cache.StaticQuantizedKVCache = StaticQuantizedKVCache
_mlx_lm_cache.StaticBatchKVCache = StaticBatchKVCache
