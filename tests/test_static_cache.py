"""StaticKVCache and StaticBatchKVCache (the CUDA fast path's caches) on any backend: same contents
as mlx-lm's KVCache / BatchKVCache through prefill, decode, growth and batching, and the explicit
ordering of in-place writers after readers."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache

from mlx_fastops.backends.cuda.cache import StaticBatchKVCache, StaticKVCache


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


def _kv(B, L, seed):
    return (mx.random.normal((B, 3, L, 8), key=mx.random.key(seed)),
            mx.random.normal((B, 3, L, 8), key=mx.random.key(1000 + seed)))


def _same(ours, ref):
    assert type(ours) is StaticBatchKVCache
    assert ours._idx == ref._idx and ours.keys.shape == ref.keys.shape
    for a, b in zip(ours.state[:4], ref.state[:4]):
        assert mx.array_equal(a, b)


# What mlx-lm's BatchGenerator does to a batch cache, as (method, arguments) in order; "decode"
# stands for one update_and_fetch of one token per row (B is the batch's current row count).
BATCH_SCRIPTS = [
    [("decode",), ("decode",)],
    [("prepare", dict(lengths=[3, 5, 2], right_padding=[2, 0, 3])), ("prefill", 5), ("finalize",), ("decode",)],
    [("filter", [0, 2]), ("decode",), ("filter", [1])],                 # the unpadded row leaves: shift
    [("extend", 2, 7), ("decode",), ("extend", 1, 300), ("decode",)],   # a longer row joins: growth
    [("trim", 2), ("decode",)],
]


@pytest.mark.parametrize("script", BATCH_SCRIPTS)
def test_batch_cache_matches_batch_kv_cache(script):
    """StaticBatchKVCache through mlx-lm's batching: merged from StaticKVCaches (what the patched
    model's make_cache returns) and then every BatchKVCache method, with the same contents as
    mlx-lm's BatchKVCache merged from KVCaches."""
    singles = [], []
    for i, n in enumerate((4, 9, 6)):
        for caches, cls in zip(singles, (StaticKVCache, KVCache)):
            caches.append(cls())
            caches[-1].update_and_fetch(*_kv(1, n, i))
    ours, ref = StaticKVCache.merge(singles[0]), KVCache.merge(singles[1])
    _same(ours, ref)
    for seed, (op, *args) in enumerate(script):
        B = ref.left_padding.shape[0]
        if op in ("decode", "prefill"):
            kv = _kv(B, args[0] if args else 1, seed)
            for a, b in zip(ours.update_and_fetch(*kv), ref.update_and_fetch(*kv)):
                assert mx.array_equal(a, b)
        elif op == "extend":
            new = [StaticBatchKVCache([0] * args[0]), BatchKVCache([0] * args[0])]
            kv = _kv(args[0], args[1], seed)
            for c in new:
                c.update_and_fetch(*kv)
            ours.extend(new[0])
            ref.extend(new[1])
        else:
            kwargs = args.pop() if args and isinstance(args[-1], dict) else {}
            for c in (ours, ref):
                getattr(c, op)(*args, **kwargs)
        _same(ours, ref)
    one = ours.extract(0)
    assert type(one) is StaticKVCache and mx.array_equal(one.keys, ref.extract(0).keys)


def test_batch_cache_fast_path_bookkeeping():
    """What the fast path does to a StaticBatchKVCache: buffers grown as update_and_fetch grows
    them, the write index and every row's offset advanced (the offset folded in when read), the
    writer ordered after the last reader, stock methods after the fast path's kernels."""
    c, ref = StaticBatchKVCache([2, 0]), BatchKVCache([2, 0])
    for cache in (c, ref):
        cache.update_and_fetch(*_kv(2, 255, 0))
    assert c.takes(2, 3, 8, mx.float32) and not c.takes(3, 3, 8, mx.float32)
    c.reserve(2, 3, 8, mx.float32, 257)
    ref.update_and_fetch(*_kv(2, 2, 1))
    assert c.keys.shape == ref.keys.shape and mx.array_equal(c.keys[:, :, :255], ref.keys[:, :, :255])
    reader = mx.ones((3,))
    c.advance(2, reader)
    lp = c.fast_inputs()[3]
    assert c.position() == 257 and c.fast_inputs()[2] is reader and c.fast_inputs()[3] is lp   # made once
    assert lp.dtype == mx.int32 and lp.tolist() == [2, 0, 0, 0]   # 16 bytes: out of MLX's small pool
    assert c.offset.tolist() == [255, 257]
    c.filter([0])
    assert c.last_reader is None and c._idx == 255 and c.offset.tolist() == [255]
    c.left_padding += 3   # in place, as mlx-lm changes it: the kernels' copy follows
    assert c.fast_inputs()[3].tolist() == [3, 0, 0, 0]
    c.prepare(right_padding=[1])
    assert not c.takes(1, 3, 8, mx.float32)   # a prompt chunk before finalize: stock's path


# (kv_bits, group size, the converted cache's class: the fast path's where its kernels take the format)
TO_QUANTIZED = [(8, 64, "StaticQuantizedKVCache"), (4, 32, "StaticQuantizedKVCache"), (2, 64, "QuantizedKVCache")]


@pytest.mark.parametrize("bits,group,cls", TO_QUANTIZED)
def test_to_quantized_after_the_fast_path(bits, group, cls):
    """mlx-lm's kv_bits conversion (maybe_quantize_kv_cache): a QuantizedKVCache holding exactly
    what KVCache.to_quantized gives for the same rows, after the last reader was finished (the fast
    path's in-place writes are done), and decoding on from there like mlx-lm's own, across a growth
    of its buffers. On the CPU the order itself cannot be seen: this checks that the last reader
    was finished and cleared."""
    from mlx_lm.models.cache import QuantizedKVCache

    ours, ref = StaticKVCache(), KVCache()
    k = mx.random.normal((1, 2, 300, 64)).astype(mx.bfloat16)
    for c in (ours, ref):
        c.update_and_fetch(k, k + 1)
    ours.last_reader = mx.ones((3,))
    q_ours, q_ref = ours.to_quantized(group_size=group, bits=bits), ref.to_quantized(group_size=group, bits=bits)
    assert ours.last_reader is None
    assert type(q_ours).__name__ == cls and isinstance(q_ours, QuantizedKVCache)
    assert (q_ours.offset, q_ours.bits, q_ours.group_size) == (300, bits, group)
    for n in (1, 900):   # one decode step, then a prompt chunk past the first buffer's 1024 slots
        step = mx.random.normal((1, 2, n, 64)).astype(mx.bfloat16)
        for a, b in zip(q_ours.update_and_fetch(step, step - 1), q_ref.update_and_fetch(step, step - 1)):
            for x, y in zip(a, b):   # (packed, scales, biases) of keys, then of values
                assert x.shape == y.shape and x.dtype == y.dtype and mx.array_equal(x, y)
    assert q_ours.offset == 1201


# (tokens in the cache (of 2 kv heads, head dim 64, bf16), rows, kv heads, head dim, dtype, kv_bits,
# group size, whether the fast path takes the cache)
QUANTIZED_TAKES = [
    (5, 1, 2, 64, mx.bfloat16, 8, 64, True),
    (5, 8, 2, 64, mx.bfloat16, 4, 32, True),
    (0, 1, 2, 64, mx.bfloat16, 8, 64, True),    # empty: its buffers are made on the first step
    (0, 9, 2, 64, mx.bfloat16, 8, 64, False),   # more rows than the one-launch layer's
    (5, 1, 3, 64, mx.bfloat16, 8, 64, False),   # other kv heads than the buffers'
    (5, 1, 2, 128, mx.bfloat16, 8, 64, False),  # another head dim
    (5, 1, 2, 64, mx.float16, 8, 64, False),    # scales in another dtype
    (0, 1, 2, 64, mx.bfloat16, 8, 128, False),  # groups that do not tile the head
]


@pytest.mark.parametrize("tokens,B,n_kv,D,dtype,bits,group,takes", QUANTIZED_TAKES)
def test_static_quantized_cache_takes(tokens, B, n_kv, D, dtype, bits, group, takes):
    c = StaticKVCache()
    if tokens:
        k = mx.random.normal((B, 2, tokens, 64)).astype(mx.bfloat16)
        c.update_and_fetch(k, k)
    q = c.to_quantized(group_size=group, bits=bits)
    assert q.takes(B, n_kv, D, dtype) is takes


def test_static_quantized_cache_saves_and_loads(tmp_path):
    """save_prompt_cache / load_prompt_cache (mlx_lm.cache_prompt) of a converted cache: the same
    class and contents back (mlx-lm finds the class by name in its cache module)."""
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    c = StaticKVCache()
    k = mx.random.normal((1, 2, 7, 64)).astype(mx.bfloat16)
    c.update_and_fetch(k, k * 2)
    q = c.to_quantized(group_size=64, bits=8)
    save_prompt_cache(str(tmp_path / "c.safetensors"), [q])
    loaded, = load_prompt_cache(str(tmp_path / "c.safetensors"))
    assert type(loaded) is type(q) and (loaded.offset, loaded.bits, loaded.group_size) == (7, 8, 64)
    for a, b in zip(loaded.keys_and_values(), q.keys_and_values()):
        for x, y in zip(a, b):
            assert mx.array_equal(x, y)


def test_the_compiled_step_takes_one_quantised_format():
    """Layers sharing a launch share its cache format: caches of two formats (each one the fast
    path takes) go to the composed ops."""
    from types import SimpleNamespace

    from mlx_fastops.backends.cuda.step import _fast_caches

    fb = SimpleNamespace(HKV=2, D=64, dtype=mx.bfloat16)

    def converted(bits, group):
        c = StaticKVCache()
        k = mx.random.normal((1, 2, 5, 64)).astype(mx.bfloat16)
        c.update_and_fetch(k, k)
        return c.to_quantized(group_size=group, bits=bits)

    assert _fast_caches([fb, fb], [converted(8, 64), converted(8, 64)], 1)
    assert not _fast_caches([fb, fb], [converted(8, 64), converted(4, 32)], 1)
