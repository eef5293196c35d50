"""What the op table (tests/test_ops.py) cannot check of the Metal RMSNorm + residual and q/k
RMSNorm + RoPE kernels (metal/norm_rope.metal): run-time fallbacks, the inverse frequencies, which
RoPE variants are refused, and the strict compile tier.
"""


import mlx.core as mx
import numpy as np
import pytest
from metal_fixtures import strict_factory
from mlx_lm.models.rope_utils import initialize_rope

from mlx_fastops import ops
from mlx_fastops.backends import reference
from mlx_fastops.backends.metal import norm_rope as NR
from mlx_fastops.ops.weights import RopeSpec

pytestmark = pytest.mark.metal


def f32(a):
    return np.array(a.astype(mx.float32))


def rand(shape, dtype, seed):
    return mx.random.normal(shape, key=mx.random.key(seed)).astype(dtype)


def test_rms_norm_residual_fallbacks():
    x = rand((1, 2, 256), mx.float16, 0)
    r = rand((1, 2, 256), mx.float16, 1)
    w = mx.ones((256,), mx.float16)
    # mixed dtypes run the reference op
    _, n = NR.rms_norm_residual(x, r.astype(mx.float32), w, 1e-5)
    _, n0 = reference.rms_norm_residual(x, r.astype(mx.float32), w, 1e-5)
    np.testing.assert_array_equal(f32(n), f32(n0))
    assert NR.unsupported_rms_norm_residual(hidden=1 << 15, dtype=mx.float16)
    assert NR.unsupported_rms_norm_residual(hidden=1024, dtype=mx.bfloat16) is None


def llama3_rope(dims):
    cfg = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}
    return RopeSpec.from_module(initialize_rope(dims, 500000.0, False, cfg, 131072))


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
