"""Metal RMSNorm + residual and q/k RMSNorm + RoPE (metal/norm_rope.metal) against the reference.

On Linux the kernels run in the CPU emulator (emulator-verified, not Metal-verified); on a Mac on the
GPU. The reference composes mx.fast.rms_norm and mx.fast.rope, so this is also their semantics:
half-split and traditional rotation, partial rotation (dims < head_dim), Llama-3 `freqs` (periods),
`scale`, the cache offset as the position of token 0.
"""


import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.rope_utils import initialize_rope

from mlx_fastops import ops
from mlx_fastops.backends import reference
from mlx_fastops.backends.metal import norm_rope as NR
from mlx_fastops.ops.weights import RopeSpec

pytestmark = pytest.mark.metal

# one or two ulps of the output dtype at |x| ~ 4 (RoPE's cos/sin differ from MLX's CPU rope in the
# last bit; RMSNorm rounds where stock rounds)
TOL = {mx.float16: 4e-3, mx.bfloat16: 3.2e-2, mx.float32: 2e-5}


def f32(a):
    return np.array(a.astype(mx.float32))


def assert_close(out, ref, dtype, rel=False):
    o, r = f32(out), f32(ref)
    assert o.shape == r.shape, (o.shape, r.shape)
    assert np.isfinite(o).all()
    err = np.abs(o - r).max()
    assert err <= TOL[dtype] * max(1.0, np.abs(r).max() / 4), f"max abs error {err}"


def rand(shape, dtype, seed, scale=1.0):
    return (scale * mx.random.normal(shape, key=mx.random.key(seed))).astype(dtype)


# ---------------------------------------------------------------------------------------------
# RMSNorm + residual


@pytest.mark.parametrize("shape,dtype", [
    ((1, 1, 1024), mx.float16), ((1, 2, 1024), mx.bfloat16), ((1, 3, 192), mx.float16),
    ((4, 1, 1000), mx.bfloat16), ((1, 7, 2560), mx.float16), ((2, 1, 4096), mx.bfloat16),
    ((1, 1, 33), mx.float32), ((1, 5, 96), mx.float16),
], ids=str)
def test_rms_norm_residual(shape, dtype):
    x = rand(shape, dtype, 0, 3.0)
    r = rand(shape, dtype, 1, 3.0)
    w = (1 + 0.1 * mx.random.normal((shape[-1],), key=mx.random.key(2))).astype(dtype)
    h, n = NR.rms_norm_residual(x, r, w, 1e-6)
    h0, n0 = reference.rms_norm_residual(x, r, w, 1e-6)
    assert h.dtype == n.dtype == dtype and h.shape == n.shape == shape
    np.testing.assert_array_equal(f32(h), f32(h0))  # the add rounds exactly as stock
    assert_close(n, n0, dtype)


def test_rms_norm_residual_op_entry_and_fallback():
    x = rand((1, 2, 256), mx.float16, 0)
    r = rand((1, 2, 256), mx.float16, 1)
    w = mx.ones((256,), mx.float16)
    h, n = ops.rms_norm_residual(x, r, w, 1e-5, backend="metal")
    h0, n0 = reference.rms_norm_residual(x, r, w, 1e-5)
    assert_close(n, n0, mx.float16)
    # mixed dtypes run the reference op
    h, n = NR.rms_norm_residual(x, r.astype(mx.float32), w, 1e-5)
    h0, n0 = reference.rms_norm_residual(x, r.astype(mx.float32), w, 1e-5)
    np.testing.assert_array_equal(f32(n), f32(n0))
    assert NR.unsupported_rms_norm_residual(hidden=1 << 15, dtype=mx.float16)
    assert NR.unsupported_rms_norm_residual(hidden=1024, dtype=mx.bfloat16) is None


# ---------------------------------------------------------------------------------------------
# q/k RMSNorm + RoPE


def llama3_rope(dims):
    cfg = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}
    return RopeSpec.from_module(initialize_rope(dims, 500000.0, False, cfg, 131072))


def qkv_views(B, L, H, Hk, D, dtype, seed):
    """q [B,L,H,D] and k [B,L,Hkv,D] as the strided views of one fused QKV output (as the patcher's)."""
    qkv = rand((B, L, (H + 2 * Hk) * D), dtype, seed, 2.0)
    q = qkv[..., : H * D].reshape(B, L, H, D)
    k = qkv[..., H * D:(H + Hk) * D].reshape(B, L, Hk, D)
    return q, k


NR_GRID = [
    # (B, L, H, Hkv, D, rope, norm, offset, dtype)
    (1, 1, 16, 8, 128, RopeSpec(128, False, 1e6, 1.0), True, 37, mx.bfloat16),   # Qwen3-0.6B decode
    (1, 5, 4, 2, 128, RopeSpec(128, False, 1e6, 1.0), True, 0, mx.float16),      # prefill
    (1, 3, 4, 1, 64, RopeSpec(64, False, 1e4, 1.0), False, 4000, mx.float16),    # llama/qwen2: no norm
    (1, 2, 2, 2, 64, RopeSpec(64, True, 1e4, 1.0), True, 11, mx.bfloat16),       # traditional
    (1, 2, 2, 1, 128, RopeSpec(32, True, 1e4, 1.0), False, 3, mx.float16),       # traditional, partial
    (1, 2, 4, 2, 256, RopeSpec(128, False, 1e4, 0.25), True, 9, mx.float16),     # partial, scale
    (2, 3, 8, 1, 64, None, False, 100, mx.bfloat16),                             # Llama-3 freqs (64)
    (1, 1, 4, 2, 128, None, True, 8191, mx.float16),                             # Llama-3 freqs (128)
    (1, 2, 2, 1, 64, RopeSpec(64, False, 1e4, 1.0), True, 5, mx.float32),
]


@pytest.mark.parametrize("B,L,H,Hk,D,rope,norm,offset,dtype", NR_GRID, ids=lambda v: str(v).split(".")[-1])
def test_qk_norm_rope(B, L, H, Hk, D, rope, norm, offset, dtype):
    if rope is None:
        rope = llama3_rope(D)
    q, k = qkv_views(B, L, H, Hk, D, dtype, 0)
    qn = (1 + 0.1 * mx.random.normal((D,), key=mx.random.key(5))).astype(dtype) if norm else None
    kn = (1 + 0.1 * mx.random.normal((D,), key=mx.random.key(6))).astype(dtype) if norm else None
    qo, ko = NR.qk_norm_rope(q, k, qn, kn, 1e-6, rope, offset)
    q0, k0 = reference.qk_norm_rope(q, k, qn, kn, 1e-6, rope, offset)
    assert qo.shape == (B, H, L, D) and ko.shape == (B, Hk, L, D) and qo.dtype == ko.dtype == dtype
    assert_close(qo, q0, dtype)
    assert_close(ko, k0, dtype)


def test_qk_norm_rope_offset_array_and_op_entry():
    rope = RopeSpec(64, False, 1e4, 1.0)
    q, k = qkv_views(1, 2, 2, 1, 64, mx.float16, 1)
    qn = mx.ones((64,), mx.float16)
    qo, ko = ops.qk_norm_rope(q, k, qn, qn, 1e-6, rope, mx.array(17), backend="metal")
    q0, k0 = reference.qk_norm_rope(q, k, qn, qn, 1e-6, rope, 17)
    assert_close(qo, q0, mx.float16)
    assert_close(ko, k0, mx.float16)


def test_inv_freq_matches_rope_schedules():
    spec = RopeSpec(128, False, 1e6, 1.0)
    f = np.array(NR.inv_freq(spec))
    np.testing.assert_allclose(f, 1e6 ** (-np.arange(64) / 64), rtol=1e-6)
    l3 = llama3_rope(64)
    np.testing.assert_allclose(np.array(NR.inv_freq(l3)), 1 / np.array(l3.freqs), rtol=1e-6)
    assert NR.inv_freq(spec) is NR.inv_freq(spec)  # cached per spec


def test_unsupported_rope_is_reported():
    assert NR.unsupported_qk_norm_rope(head_dim=96, rope=RopeSpec(96, False, 1e4, 1.0), norm=True)
    assert NR.unsupported_qk_norm_rope(head_dim=128, rope=RopeSpec(96, False, 1e4, 1.0), norm=True)
    assert NR.unsupported_qk_norm_rope(head_dim=128, rope=RopeSpec(128, False, 1e6, 1.0), norm=True) is None
    # Step 10: head_dim is taken from the norm weights (Qwen3-0.6B: 128 != hidden 1024 / 16 heads)
    assert ops.select("qk_norm_rope", "metal", head_dim=128, rope=RopeSpec(128, False, 1e6, 1.0),
                      norm=True)[1] == "metal"


# ---------------------------------------------------------------------------------------------
# strict compile tier: every template combination the wrappers launch, compiled as C++14 with
# warnings as errors plus the Metal lint, without running.


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32], ids=str)
def test_strict_compile_tier(dtype):
    emu = pytest.importorskip("metal_emu")
    from mlx_fastops import kernels
    from test_metal_attention import strict_factory

    with kernels.use_metal_factory(strict_factory(emu)):
        for hidden in (96, 1024, 2560, 4096, 8192):
            x = mx.zeros((2, hidden), dtype)
            NR.rms_norm_residual(x, x, mx.zeros((hidden,), dtype), 1e-6)
        for D in NR.HEAD_DIMS:
            for trad in (False, True):
                for norm in (False, True):
                    q = mx.zeros((1, 2, 2, D), dtype)
                    w = mx.ones((D,), dtype) if norm else None
                    NR.qk_norm_rope(q, q, w, w, 1e-6, RopeSpec(D, trad, 1e4, 1.0), 3)
