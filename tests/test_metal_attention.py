"""Metal attention kernels (metal/attention.metal, metal/flash_attention.metal) against the reference.

On Linux every kernel runs in the CPU emulator (tests/metal_emu: poisoned outputs and threadgroup
memory, forward/reversed schedules, guard pages, strict C++14 compile of each instantiation): results
are emulator-verified, not Metal-verified. On a Mac the same tests run on the GPU.

The reference is mx.fast.scaled_dot_product_attention (the oracle of mlx_fastops.backends.reference),
so these are also its semantics: lower-right causal alignment, GQA head mapping, scale.
Grid: head_dim 64/128/256, GQA 1/2/4/8 (and 3), lengths 1, 7, 33, 255-257 (cache growth step), 1000
(split-K decode; the 1000-token prefill is `slow`), cache offsets (kL > qL), fully masked rows
(qL > kL: the kernel defines them as 0, never NaN), fp16/bf16/fp32, batch 2, strided q/k/v views,
cache slots past the valid length poisoned with NaN (the kernel must not read them).
"""

import mlx.core as mx
import numpy as np
import pytest

from mlx_fastops import ops
from mlx_fastops.backends import reference
from mlx_fastops.backends.metal import attention as A

pytestmark = pytest.mark.metal

TOL = {mx.float16: 3e-3, mx.bfloat16: 2e-2, mx.float32: 2e-5}


def f32(a):
    return np.array(a.astype(mx.float32))


def assert_close(out, ref, dtype, what=""):
    o, r = f32(out), f32(ref)
    assert o.shape == r.shape, (o.shape, r.shape)
    assert np.isfinite(o).all(), f"{what}: non-finite output"
    tol = TOL[dtype]
    err = np.abs(o - r).max() if o.size else 0.0
    assert err <= tol * (1 + np.abs(r).max()), f"{what}: max abs error {err}"


def rand(shape, dtype, seed):
    return (mx.random.normal(shape, key=mx.random.key(seed))).astype(dtype)


@pytest.fixture
def emu_min_schedules(metal_backend):
    """Large cases run one schedule in the emulator (order checks are covered by the small cases)."""
    if metal_backend != "emulator":
        yield
        return
    import metal_emu

    old = metal_emu.config.schedules
    metal_emu.config.schedules = "min"
    yield
    metal_emu.config.schedules = old


# ---------------------------------------------------------------------------------------------
# decode


def decode_case(B, Hk, G, D, length, s_alloc, dtype, seed=0, poison=True):
    q = rand((B, Hk * G, 1, D), dtype, seed)
    k = rand((B, Hk, s_alloc, D), dtype, seed + 1)
    v = rand((B, Hk, s_alloc, D), dtype, seed + 2)
    if poison and s_alloc > length:
        # slots past the valid length hold NaN: the kernel must not read them
        pos = mx.arange(s_alloc).reshape(1, 1, s_alloc, 1)
        k = mx.where(pos < length, k, mx.array(float("nan"), dtype))
        v = mx.where(pos < length, v, mx.array(float("nan"), dtype))
    mx.eval(q, k, v)
    return q, k, v


DECODE_GRID = [
    # (B, Hkv, G, D, length, S_alloc, dtype)
    *[(1, 2, G, D, 33, 256, dt) for D in (64, 128, 256) for G, dt in
      ((1, mx.float16), (2, mx.bfloat16), (4, mx.float16), (8, mx.bfloat16))],
    *[(1, 2, 2, 128, n, 256 * (-(-n // 256)), mx.float16) for n in (1, 7, 33, 255, 256, 257)],
    (1, 1, 4, 64, 1000, 1024, mx.bfloat16),   # split over 8 chunks + reduce
    (1, 8, 2, 128, 300, 512, mx.float16),     # Qwen3-0.6B shape, 3 chunks
    (1, 1, 8, 256, 400, 512, mx.float16),     # G=8, D=256: 2 SIMD-groups a threadgroup
    (2, 2, 3, 64, 129, 256, mx.bfloat16),     # batch 2, G=3 (not a power of two)
    (1, 2, 2, 64, 77, 256, mx.float32),
]


@pytest.mark.parametrize("B,Hk,G,D,length,s_alloc,dtype", DECODE_GRID,
                         ids=lambda v: str(v).split(".")[-1])
def test_decode_attention(B, Hk, G, D, length, s_alloc, dtype):
    q, k, v = decode_case(B, Hk, G, D, length, s_alloc, dtype)
    scale = D ** -0.5
    out = A.decode_attention(q, k, v, length, scale)
    ref = reference.decode_attention(q, k, v, length, scale)
    assert out.shape == (B, Hk * G, 1, D) and out.dtype == dtype
    assert_close(out, ref, dtype, f"decode len={length}")


def test_decode_attention_strided_query_and_op_entry():
    """q as the transposed [B, L, H, D] view mlx-lm produces; through ops.decode_attention."""
    B, Hk, G, D, length = 1, 2, 2, 64, 40
    _, k, v = decode_case(B, Hk, G, D, length, 256, mx.float16)
    q = rand((B, 1, Hk * G, D), mx.float16, 7).transpose(0, 2, 1, 3)
    out = ops.decode_attention(q, k, v, length, 0.125, backend="metal")
    assert_close(out, reference.decode_attention(q, k, v, length, 0.125), mx.float16)


def test_decode_split_policy():
    assert A.decode_chunks(100, 8) == (1, 100)
    n, chunk = A.decode_chunks(1000, 8)
    assert n > 1 and (n - 1) * chunk < 1000 <= n * chunk
    for length in (129, 257, 1000, 4097, 65536):
        for bh in (1, 2, 8, 64):
            n, chunk = A.decode_chunks(length, bh)
            assert 1 <= n <= A.MAX_CHUNKS and (n - 1) * chunk < length <= n * chunk
    for D in A.HEAD_DIMS:
        for G in range(1, 9):
            assert A.decode_nsg(D, G) * G * D * 4 <= 16384


# ---------------------------------------------------------------------------------------------
# prefill


def flash_case(B, Hk, G, D, qL, kL, dtype, seed=0):
    q = rand((B, Hk * G, qL, D), dtype, seed)
    k = rand((B, Hk, kL, D), dtype, seed + 1)
    v = rand((B, Hk, kL, D), dtype, seed + 2)
    mx.eval(q, k, v)
    return q, k, v


FLASH_GRID = [
    # (B, Hkv, G, D, qL, kL, mask, dtype)
    *[(1, 1, G, D, 33, 33, "causal", dt) for D in (64, 128, 256) for G, dt in
      ((1, mx.float16), (2, mx.bfloat16), (4, mx.float16), (8, mx.bfloat16))],
    *[(1, 1, 2, 64, n, n, "causal", mx.float16) for n in (1, 7, 16, 32)],
    (1, 1, 2, 128, 7, 7, None, mx.bfloat16),
    (1, 2, 1, 64, 33, 20, None, mx.float16),          # no mask, kL < qL
    (1, 1, 2, 128, 9, 41, "causal", mx.float16),      # prompt continued from a cache offset of 32
    (1, 1, 1, 64, 20, 300, "causal", mx.bfloat16),    # offset 280, many KV tiles
    (2, 2, 2, 64, 18, 18, "causal", mx.float32),      # batch 2, fp32
    (1, 1, 3, 64, 12, 12, "causal", mx.float16),      # G=3
]


@pytest.mark.parametrize("B,Hk,G,D,qL,kL,mask,dtype", FLASH_GRID, ids=lambda v: str(v).split(".")[-1])
def test_flash_attention(B, Hk, G, D, qL, kL, mask, dtype):
    q, k, v = flash_case(B, Hk, G, D, qL, kL, dtype)
    scale = D ** -0.5
    out = A.flash_attention(q, k, v, scale, mask)
    ref = reference.flash_attention(q, k, v, scale, mask)
    assert out.shape == (B, Hk * G, qL, D) and out.dtype == dtype
    assert_close(out, ref, dtype, f"flash qL={qL} kL={kL} mask={mask}")


def test_flash_attention_257(emu_min_schedules):
    q, k, v = flash_case(1, 1, 1, 64, 257, 257, mx.float16, seed=3)
    out = A.flash_attention(q, k, v, 0.125, "causal")
    assert_close(out, reference.flash_attention(q, k, v, 0.125, "causal"), mx.float16)


@pytest.mark.slow
def test_flash_attention_1000(emu_min_schedules):
    q, k, v = flash_case(1, 1, 1, 64, 1000, 1000, mx.bfloat16, seed=4)
    out = A.flash_attention(q, k, v, 0.125, "causal")
    assert_close(out, reference.flash_attention(q, k, v, 0.125, "causal"), mx.bfloat16)


@pytest.mark.parametrize("D,dtype", [(64, mx.float16), (256, mx.bfloat16)])
def test_flash_attention_fully_masked_rows(D, dtype):
    """qL > kL with a lower-right causal mask: the first qL - kL query rows see no key.

    Stock semantics differ there (CPU SDPA: the mean of V; Metal steel: implementation-defined); the
    kernel defines such rows as 0 and never produces NaN. The other rows match the reference."""
    qL, kL = 21, 6
    q, k, v = flash_case(1, 1, 2, D, qL, kL, dtype, seed=5)
    out = f32(A.flash_attention(q, k, v, D ** -0.5, "causal"))
    ref = f32(reference.flash_attention(q, k, v, D ** -0.5, "causal"))
    assert np.isfinite(out).all()
    masked = qL - kL
    assert (out[:, :, :masked] == 0).all()
    err = np.abs(out[:, :, masked:] - ref[:, :, masked:]).max()
    assert err <= TOL[dtype] * (1 + np.abs(ref).max())


def test_flash_attention_cache_views():
    """k/v as the strided slices KVCache.update_and_fetch returns, q as the transposed view."""
    B, Hk, G, D, qL, offset = 1, 2, 2, 64, 10, 13
    kL = offset + qL
    buf_k = rand((B, Hk, 256, D), mx.float16, 1)
    buf_v = rand((B, Hk, 256, D), mx.float16, 2)
    k, v = buf_k[..., :kL, :], buf_v[..., :kL, :]
    q = rand((B, qL, Hk * G, D), mx.float16, 3).transpose(0, 2, 1, 3)
    out = ops.flash_attention(q, k, v, 0.125, "causal", backend="metal")
    assert_close(out, reference.flash_attention(q, k, v, 0.125, "causal"), mx.float16)
    # the output is [B, qL, H, D] in memory: o_proj's transpose + reshape is a free view
    flat = out.transpose(0, 2, 1, 3).reshape(B, qL, -1)
    assert_close(flat, reference.flash_attention(q, k, v, 0.125, "causal").transpose(0, 2, 1, 3).reshape(B, qL, -1),
                 mx.float16)


def test_flash_attention_array_mask_falls_back():
    q, k, v = flash_case(1, 1, 2, 64, 5, 9, mx.float16)
    mask = mx.random.uniform(shape=(5, 9), key=mx.random.key(1)) > 0.3
    out = A.flash_attention(q, k, v, 0.125, mask)
    np.testing.assert_array_equal(f32(out), f32(reference.flash_attention(q, k, v, 0.125, mask)))
    assert A.unsupported_flash_attention(head_dim=64, gqa=2, mask="array")
    _, used, reason = ops.select("flash_attention", "metal", head_dim=64, gqa=2, dtype=mx.float16, mask="array")
    assert used == "reference" and "array" in reason


def test_unsupported_shapes_are_reported():
    assert A.unsupported_decode_attention(head_dim=96, gqa=2)
    assert A.unsupported_decode_attention(head_dim=128, gqa=16)
    assert A.unsupported_flash_attention(head_dim=80, gqa=1, mask="causal")
    assert A.unsupported_decode_attention(head_dim=128, gqa=2, dtype=mx.float16) is None
    assert A.unsupported_flash_attention(head_dim=256, gqa=8, dtype=mx.bfloat16, mask="causal") is None
    # Step 10: head_dim comes from the weights/config (Qwen3-0.6B: 128, not hidden/heads = 64)
    assert ops.select("decode_attention", "metal", head_dim=128, gqa=2)[1] == "metal"


# ---------------------------------------------------------------------------------------------
# strict compile tier: every instantiation the wrappers can launch (head_dim x GQA x dtype x path),
# compiled as C++14 with warnings as errors plus the Metal lint, without running them.


def strict_factory(emu):
    """A metal_kernel factory whose kernels strict-compile each call's instantiation and return zeros."""

    def factory(**spec):
        def call(*, inputs, output_shapes, output_dtypes, grid, threadgroup, template=None, init_value=None, **_):
            emu.compile_strict(**spec, inputs=inputs, output_shapes=output_shapes, output_dtypes=output_dtypes,
                               template=template, grid=grid, threadgroup=threadgroup, init_value=init_value)
            return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]

        return call

    return factory


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32], ids=str)
@pytest.mark.parametrize("D", A.HEAD_DIMS)
def test_strict_compile_tier(D, dtype):
    emu = pytest.importorskip("metal_emu")
    from mlx_fastops import kernels

    with kernels.use_metal_factory(strict_factory(emu)):
        for G in (1, 2, 3, 4, 8):
            for length in (5, 1000):  # one chunk; split + reduce
                q = mx.zeros((1, 2 * G, 1, D), dtype)
                kv = mx.zeros((1, 2, 1024, D), dtype)
                A.decode_attention(q, kv, kv, length, 0.1)
        for causal in (None, "causal"):
            q = mx.zeros((1, 2, 20, D), dtype)
            kv = mx.zeros((1, 1, 20, D), dtype)
            A.flash_attention(q, kv, kv, 0.1, causal)
            qkv = (mx.zeros((1, 1, 20, D // 4), mx.uint32), mx.zeros((1, 1, 20, D // 64), dtype),
                   mx.zeros((1, 1, 20, D // 64), dtype))
            A.flash_attention_q8(q, qkv, qkv, 0.1, causal, 64, 8)


# ---------------------------------------------------------------------------------------------
# prefill over an int8 KV cache (QuantizedKVCache, kv_bits=8)


@pytest.mark.parametrize("D,G,qL,offset,group,dtype", [
    (64, 2, 9, 0, 64, mx.float16),
    (128, 1, 5, 20, 32, mx.bfloat16),
    (256, 4, 17, 3, 64, mx.float16),
    (128, 8, 33, 0, 128, mx.bfloat16),
    (128, 2, 1, 0, 64, mx.float16),  # scales of 4 elements: MLX would pass them in `constant` memory
], ids=lambda v: str(v).split(".")[-1])
def test_flash_attention_q8(D, G, qL, offset, group, dtype):
    from mlx_lm.models.base import quantized_scaled_dot_product_attention as stock_q
    from mlx_lm.models.cache import QuantizedKVCache

    kL = offset + qL
    k, v = rand((1, 2, kL, D), dtype, 1), rand((1, 2, kL, D), dtype, 2)
    q = rand((1, 2 * G, qL, D), dtype, 3)
    cache = QuantizedKVCache(group_size=group, bits=8)
    if offset:
        cache.update_and_fetch(k[..., :offset, :], v[..., :offset, :])
    qk, qv = cache.update_and_fetch(k[..., offset:, :], v[..., offset:, :])  # strided slices of the buffers
    scale = D ** -0.5
    out = A.flash_attention_q8(q, qk, qv, scale, "causal", group, 8)
    # oracle: float32 SDPA over the dequantised cache
    dk = mx.dequantize(*qk, group_size=group, bits=8).astype(mx.float32)
    dv = mx.dequantize(*qv, group_size=group, bits=8).astype(mx.float32)
    ref = mx.fast.scaled_dot_product_attention(q.astype(mx.float32), dk, dv, scale=scale, mask="causal")
    assert_close(out, ref, dtype, "q8 vs dequantised SDPA")
    # and mlx-lm's own quantized path (it rounds q * scale and the scores to the model dtype)
    stock = stock_q(mx.array(q), qk, qv, scale=scale, mask="causal", group_size=group, bits=8)
    assert np.abs(f32(out) - f32(stock)).max() <= 4 * TOL[dtype] * (1 + np.abs(f32(stock)).max())


def test_flash_attention_q8_fallbacks():
    assert A.unsupported_flash_attention_q8(head_dim=128, gqa=2, bits=4)
    assert A.unsupported_flash_attention_q8(head_dim=64, gqa=2, bits=8, group_size=128)
    assert A.unsupported_flash_attention_q8(head_dim=128, gqa=2, bits=8, group_size=64) is None


def test_emulator_flags_a_missing_softmax_pv_barrier(metal_backend, monkeypatch):
    """The barrier between softmax and P.V is load-bearing (MNN pitfall 4): without it the emulator
    reports reads of threadgroup memory no lane wrote yet."""
    if metal_backend != "emulator":
        pytest.skip("negative test of the emulator's checks")
    import metal_emu

    from mlx_fastops import kernels
    from mlx_fastops.backends.metal import norm_rope

    orig = norm_rope.sections(A.FLASH_SOURCE)
    body = orig["flash_attention"]
    barrier = "threadgroup_barrier(mem_flags::mem_threadgroup);"
    j = body.rindex(barrier, 0, body.index("// ---- O = O * alpha + P . V"))
    broken = dict(orig, flash_attention=body[:j] + body[j + len(barrier):])
    monkeypatch.setattr(A, "sections", lambda f: broken if f == A.FLASH_SOURCE else norm_rope.sections(f))
    kernels.clear_builders()
    try:
        q, k, v = flash_case(1, 1, 2, 64, 33, 33, mx.float16)
        with pytest.raises(metal_emu.KernelError, match="uninitialized-threadgroup-read|order"):
            A.flash_attention(q, k, v, 0.125, "causal")
    finally:
        kernels.clear_builders()
