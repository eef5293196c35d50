"""StaticKVCache: the KV cache of the fast decode path, written in place by its kernels."""

import mlx.core as mx
from mlx_lm.models import cache as _mlx_lm_cache
from mlx_lm.models.cache import KVCache


class StaticKVCache(KVCache):
    """KVCache whose buffers grow in big steps and are written in place by the fast decode path.

    Prefill (and every path that is not the fast path) writes through `update_and_fetch` exactly
    like KVCache (slice assignment, in place when MLX can donate); the fast decode kernels write
    the new k/v rows straight into `keys`/`values` at `offset`.

    MLX does not see those in-place writes, and MLX's CUDA graphs order kernels only by the
    buffers they declare (a kernel waits for the last kernel that output one of its input
    buffers). So the order is made explicit: `last_reader` is the output of the latest fast-path
    attention over the buffers; the next fast-path writer (the head kernel) takes it as an extra
    input, and stock code that touches the buffers (`update_and_fetch`, growth) evaluates it
    first. Without this, steps built lazily whose inputs do not depend on each other (teacher
    forcing) could run out of order in one graph.
    """

    step = 1024
    last_reader = None

    def _ordered(self):
        """Finish the fast path's pending kernels before stock ops read or write the buffers."""
        if self.last_reader is not None:
            mx.eval(self.last_reader)
            self.last_reader = None

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
        B, n_kv, L, D = keys.shape
        prev = self.offset
        self.reserve(B, n_kv, D, keys.dtype, prev + L)
        self._ordered()
        self.offset += L
        self.keys[..., prev : self.offset, :] = keys
        self.values[..., prev : self.offset, :] = values
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    def to_quantized(self, group_size=64, bits=4):
        """mlx-lm's conversion to a QuantizedKVCache (generate_step's kv_bits), of the buffers as
        the fast path's pending in-place writes leave them."""
        self._ordered()
        return super().to_quantized(group_size=group_size, bits=bits)

    def fast_inputs(self):
        """(keys, values, after) for the fast path's in-place writer; `after` is the last reader
        (the writer's kernel takes it as an input, so it waits for it), else the keys again."""
        return self.keys, self.values, self.keys if self.last_reader is None else self.last_reader


# mlx-lm's load_prompt_cache finds cache classes by name in its own module: let it find ours, so a
# prompt cache saved from a patched model (mlx_lm.cache_prompt, save_prompt_cache) loads again.
_mlx_lm_cache.StaticKVCache = StaticKVCache
