"""StaticKVCache (the CUDA fast path's cache) on any backend: same contents as mlx-lm's KVCache
through prefill, decode and growth, and the explicit ordering of in-place writers after readers."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from mlx_fastops.backends.cuda import StaticKVCache


@pytest.mark.parametrize("steps", [(5, 1, 1, 300), (1024, 1), (1023, 2, 1)])
def test_matches_kv_cache(steps):
    ours, ref = StaticKVCache(), KVCache()
    for i, L in enumerate(steps):
        k = mx.random.normal((2, 3, L, 8), key=mx.random.key(i))
        v = mx.random.normal((2, 3, L, 8), key=mx.random.key(100 + i))
        for a, b in zip(ours.update_and_fetch(k, v), ref.update_and_fetch(k, v)):
            assert a.shape == b.shape and mx.array_equal(a, b)
    assert ours.offset == ref.offset == sum(steps)
    assert ours.keys.shape[2] % StaticKVCache.step == 0 and ours.keys.shape[2] >= ours.offset


def test_writers_ordered_after_last_reader():
    c = StaticKVCache()
    c.update_and_fetch(mx.zeros((1, 2, 4, 8)), mx.zeros((1, 2, 4, 8)))
    k0 = c.keys
    assert c.fast_buffers()[0] is k0          # no reader yet: the buffers themselves
    c.last_reader = mx.ones((3,))
    k, v = c.fast_buffers()
    assert k is not k0 and mx.array_equal(k, k0)   # same values, a new node after the reader
    # the stock writer consumes the reader once
    c.update_and_fetch(mx.ones((1, 2, 1, 8)), mx.ones((1, 2, 1, 8)))
    assert c.last_reader is None
    assert mx.array_equal(c.keys[:, :, 4], mx.ones((1, 2, 8)))
