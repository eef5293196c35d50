"""StaticKVCache (the CUDA fast path's cache) on any backend: same contents as mlx-lm's KVCache
through prefill, decode and growth, and the explicit ordering of in-place writers after readers."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from mlx_fastops.backends.cuda.cache import StaticKVCache


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
    k, v, after = c.fast_inputs()
    assert k is c.keys and v is c.values and after is c.keys   # no reader yet
    reader = mx.ones((3,)) * 2
    c.last_reader = reader
    assert c.fast_inputs()[2] is reader          # the fast path's writer takes the reader as input
    # stock code finishes the reader first and forgets it
    c.update_and_fetch(mx.ones((1, 2, 1, 8)), mx.ones((1, 2, 1, 8)))
    assert c.last_reader is None
    assert mx.array_equal(c.keys[:, :, 4], mx.ones((1, 2, 8)))


def test_saved_prompt_cache_loads_again(tmp_path):
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    c = StaticKVCache()
    k = mx.random.normal((1, 2, 5, 8))
    c.update_and_fetch(k, k + 1)
    save_prompt_cache(str(tmp_path / "c.safetensors"), [c])
    (loaded,) = load_prompt_cache(str(tmp_path / "c.safetensors"))
    assert type(loaded) is StaticKVCache and loaded.offset == 5
    keys, values = loaded.update_and_fetch(k[:, :, :1], k[:, :, :1])   # keeps working after loading
    assert keys.shape[2] == 6 and mx.array_equal(keys[:, :, :5], k)


@pytest.mark.parametrize("bits,group", [(8, 64), (4, 32)])
def test_to_quantized_after_the_fast_path(bits, group):
    """mlx-lm's kv_bits conversion (maybe_quantize_kv_cache): a QuantizedKVCache holding exactly
    what KVCache.to_quantized gives for the same rows, after the last reader was finished (the fast
    path's in-place writes are done), and decoding on from there like mlx-lm's own."""
    from mlx_lm.models.cache import QuantizedKVCache

    ours, ref = StaticKVCache(), KVCache()
    k = mx.random.normal((1, 2, 300, 64)).astype(mx.bfloat16)
    for c in (ours, ref):
        c.update_and_fetch(k, k + 1)
    ours.last_reader = mx.ones((3,))
    q_ours, q_ref = ours.to_quantized(group_size=group, bits=bits), ref.to_quantized(group_size=group, bits=bits)
    assert ours.last_reader is None
    assert type(q_ours) is QuantizedKVCache and (q_ours.offset, q_ours.bits, q_ours.group_size) == (300, bits, group)
    step = mx.random.normal((1, 2, 1, 64)).astype(mx.bfloat16)
    for a, b in zip(q_ours.update_and_fetch(step, step), q_ref.update_and_fetch(step, step)):
        for x, y in zip(a, b):   # (packed, scales, biases) of keys, then of values
            assert x.shape == y.shape and x.dtype == y.dtype and mx.array_equal(x, y)
