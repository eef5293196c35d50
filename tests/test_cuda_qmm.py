"""The tensor-core quantised matmul (cuda/qmm.cu) called directly, beyond the row counts the ops
give it (tests/test_ops.py covers 9-64 rows through the ops): several token tiles along the grid's
y, K split over 1-8 warps, rows past N in the last block. The exact value is x @ W^T in float64
with W the weights as the kernel feeds the tensor cores (s * q + b rounded to the dtype), so only
the summation order and the output rounding differ: within a few units in the last place.

On a GPU: `pytest -m cuda`; elsewhere through the CPU emulator of tests/cuda_emu.
"""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.activations import swiglu

from mlx_fastops import kernels
from mlx_fastops.backends.cuda import qmm
from mlx_fastops.ops.weights import PackedLinear

pytestmark = [pytest.mark.cuda]
F16, BF16 = mx.float16, mx.bfloat16
ULP = {F16: 2 ** -10, BF16: 2 ** -7}


@pytest.fixture(autouse=True)
def cuda_or_emulator():
    if mx.cuda.is_available():
        yield
        return
    import cuda_emu
    with kernels.use_cuda_factory(cuda_emu.cuda_kernel):
        yield


def to64(a):
    return np.asarray(a.astype(mx.float32)).astype(np.float64)


CASES = [  # M, K, N, bits, group, dtype, epi, bias
    (100, 256, 72, 4, 64, BF16, 0, False),     # two token tiles, the second of 36 rows
    (130, 384, 40, 8, 32, F16, 0, True),       # three tiles, the last of 2 rows; 8-bit
    (9, 1024, 33, 4, 128, F16, 0, False),      # one tile, K over 8 warps, 1 row in the last block
    (77, 128, 64, 4, 32, BF16, 2, False),      # swiglu, one chunk of K
    (65, 512, 96, 8, 64, BF16, 2, False),      # swiglu, 8-bit, a second tile of 1 row
]


@pytest.mark.parametrize("M,K,N,bits,gs,dtype,epi,bias", CASES)
def test_qmm_matches_its_weights_in_float64(M, K, N, bits, gs, dtype, epi, bias):
    wq, s, b = mx.quantize(mx.random.normal((N, K)) * 0.5, group_size=gs, bits=bits)
    w = PackedLinear(wq, s.astype(dtype), b.astype(dtype),
                     (0.1 * mx.random.normal((N,))).astype(dtype) if bias else None, (N,), K, bits, gs)
    x = mx.random.normal((M, K)).astype(dtype)
    assert w.scales.dtype == dtype and qmm.chunk_k(bits) <= K
    y = qmm.qmm(x, w, epi=epi)
    fed = mx.dequantize(wq, w.scales, w.biases, group_size=gs, bits=bits)   # in dtype: what the mma reads
    exact = to64(x) @ to64(fed).T
    if bias:
        exact = to64((mx.array(exact.astype(np.float32)).astype(dtype) + w.bias))
    if epi == 2:
        g, u = np.split(exact, 2, axis=-1)
        exact = to64(swiglu(mx.array(g.astype(np.float32)).astype(dtype), mx.array(u.astype(np.float32)).astype(dtype)))
    out = to64(y)
    assert out.shape == exact.shape and np.isfinite(out).all()
    err = np.abs(out - exact).max() / np.abs(exact).max()
    assert err < 4 * ULP[dtype], err
