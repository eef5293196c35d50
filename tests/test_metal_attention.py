"""What the op table (tests/test_ops.py) cannot check of the Metal attention kernels
(metal/attention.metal, metal/flash_attention.metal): the decode split policy, rows that see no key
(defined as 0 here, implementation-defined in stock), which shape classes are refused, the strict
compile tier, and that the emulator catches a missing barrier.
"""

import mlx.core as mx
import numpy as np
import pytest
from metal_fixtures import strict_factory

from mlx_fastops import ops
from mlx_fastops.backends import reference
from mlx_fastops.backends.metal import attention as A

pytestmark = pytest.mark.metal

TOL = {mx.float16: 3e-3, mx.bfloat16: 2e-2}


def f32(a):
    return np.array(a.astype(mx.float32))


def rand(shape, dtype, seed):
    return (mx.random.normal(shape, key=mx.random.key(seed))).astype(dtype)


def flash_case(B, Hk, G, D, qL, kL, dtype, seed=0):
    q = rand((B, Hk * G, qL, D), dtype, seed)
    k = rand((B, Hk, kL, D), dtype, seed + 1)
    v = rand((B, Hk, kL, D), dtype, seed + 2)
    mx.eval(q, k, v)
    return q, k, v


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


def test_unsupported_shapes_are_reported():
    assert A.unsupported_decode_attention(head_dim=96, gqa=2)
    assert A.unsupported_decode_attention(head_dim=128, gqa=16)
    assert A.unsupported_flash_attention(head_dim=80, gqa=1, mask="causal")
    assert A.unsupported_decode_attention(head_dim=128, gqa=2, dtype=mx.float16) is None
    assert A.unsupported_flash_attention(head_dim=256, gqa=8, dtype=mx.bfloat16, mask="causal") is None
    # Step 10: head_dim comes from the weights/config (Qwen3-0.6B: 128, not hidden/heads = 64)
    assert ops.select("decode_attention", "metal", head_dim=128, gqa=2)[1] == "metal"
    assert A.unsupported_flash_attention(head_dim=64, gqa=2, mask="array")
    assert A.unsupported_flash_attention_q8(head_dim=128, gqa=2, bits=4)
    assert A.unsupported_flash_attention_q8(head_dim=64, gqa=2, bits=8, group_size=128)
    assert A.unsupported_flash_attention_q8(head_dim=128, gqa=2, bits=8, group_size=64) is None


# ---------------------------------------------------------------------------------------------
# strict compile tier: every instantiation the wrappers can launch (head_dim x GQA x dtype x path),
# compiled as C++14 with warnings as errors plus the Metal lint, without running them.


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
