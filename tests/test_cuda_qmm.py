"""The tensor-core quantised matmul (cuda/qmm.cu) called directly, beyond the row counts the ops
give it (tests/test_ops.py covers 9-64 rows through the ops): several token tiles along the grid's
y, K split over 1-16 warps (with chunks left over), rows past N in the last block. The exact value
is x @ W^T in float64 with W the weights as the kernel feeds the tensor cores (s * q + b rounded
once to the dtype), rounded where the kernel rounds (the GEMV's points: T(acc), + bias, + residual,
the swiglu steps): only the summation order differs, so within a few units in the last place, and in the
emulator (float sums in k order) bit-identical almost everywhere.

On a GPU: `pytest -m cuda`; elsewhere through the CPU emulator of tests/cuda_emu.
"""

import mlx.core as mx
import numpy as np
import pytest

from mlx_fastops.backends.cuda import qmm
from mlx_fastops.ops.weights import PackedLinear

pytestmark = [pytest.mark.cuda]
F16, BF16, F32 = mx.float16, mx.bfloat16, mx.float32
ULP = {F16: 2 ** -10, BF16: 2 ** -7}


def to64(a):
    return np.asarray(a.astype(F32)).astype(np.float64)


def rounded(a, dtype):
    """float64 values rounded to dtype (through float32), back as float64."""
    return to64(mx.array(np.asarray(a, dtype=np.float32)).astype(dtype))


def expected(x, w, dtype, epi, res=None):
    fed = mx.dequantize(w.weight, w.scales.astype(F32), w.biases.astype(F32), group_size=w.group_size,
                        bits=w.bits).astype(dtype)   # s * q + b rounded once: what the mma reads
    acc = to64(x) @ to64(fed).T
    if epi == 2:
        g, u = np.split(acc, 2, axis=-1)
        g, u = rounded(g, dtype), rounded(u, dtype)
        sg = rounded(1.0 / (1.0 + np.exp(-g)), dtype)
        return rounded(rounded(g * sg, dtype) * u, dtype)
    y = rounded(acc, dtype)
    y = y if w.bias is None else rounded(y + to64(w.bias), dtype)
    return y if res is None else rounded(to64(res) + y, dtype)


CASES = [  # M, K, N, bits, group, dtype, epi, bias
    (100, 256, 72, 4, 64, BF16, 0, False),     # seven token tiles of 16, the last of 4 rows
    (130, 384, 40, 8, 32, F16, 0, True),       # nine tiles, the last of 2 rows; 8-bit
    (9, 1024, 33, 4, 128, F16, 0, False),      # one tile, K over 8 warps, 1 row in the last block
    (9, 2560, 40, 4, 64, BF16, 0, True),       # 20 chunks over 16 warps: 4 warps take one more
    (77, 128, 64, 4, 32, BF16, 2, False),      # swiglu, one chunk of K
    (20, 256, 48, 4, 32, F16, 2, False),       # swiglu in half
    (65, 512, 96, 8, 64, BF16, 2, False),      # swiglu, 8-bit, a fifth tile of 1 row
    (33, 640, 80, 4, 64, BF16, 1, False),      # + residual (o_proj / down in FastBlock.wide)
    (12, 256, 40, 8, 32, F16, 1, True),        # + bias + residual, 8-bit
    (4, 256, 40, 4, 64, BF16, 1, False),       # 4 rows (FastBlock.wide's fewest on large layers)
    (5, 512, 48, 4, 64, F16, 2, False),        # 5 rows, swiglu
    (6, 2048, 96, 4, 64, BF16, 1, False),      # + residual, 16 warps (a grid of 3 blocks), a chunk each
    (5, 2560, 64, 4, 64, F16, 2, False),       # swiglu over 16 warps
]


@pytest.mark.parametrize("M,K,N,bits,gs,dtype,epi,bias", CASES)
def test_qmm_matches_its_weights_in_float64(M, K, N, bits, gs, dtype, epi, bias, on_gpu):
    wq, s, b = mx.quantize(mx.random.normal((N, K)) * 0.5, group_size=gs, bits=bits)
    w = PackedLinear(wq, s.astype(dtype), b.astype(dtype),
                     (0.1 * mx.random.normal((N,))).astype(dtype) if bias else None, (N,), K, bits, gs)
    x = mx.random.normal((M, K)).astype(dtype)
    res = (4 * mx.random.normal((M, N))).astype(dtype) if epi == 1 else None
    out, exact = to64(qmm.qmm(x, w, epi=epi, res=res)), expected(x, w, dtype, epi, res)
    assert out.shape == exact.shape and np.isfinite(out).all()
    err = np.abs(out - exact).max() / np.abs(exact).max()
    assert err < 4 * ULP[dtype], err
    if not on_gpu:   # the GPU's tensor cores add in their own order
        same = float((out == exact).mean())
        assert same > 0.99, same


def _linear(x_dtype, rows, K, bits=4, gs=64, w_dtype=BF16, out=32):
    """x and a weight of `out` rows as takes() sees them (the arrays hold 32: takes reads no data)."""
    wq, s, b = mx.quantize(mx.zeros((32, K)), group_size=gs, bits=bits)
    return mx.zeros((rows, K), x_dtype), PackedLinear(wq, s.astype(w_dtype), b.astype(w_dtype), None, (out,), K, bits, gs)


TAKES = [  # x dtype, rows, K, bits, group, scales' dtype, taken
    (BF16, 9, 256, 4, 64, BF16, True),
    (F16, 64, 128, 4, 32, F16, True),
    (BF16, 64, 64, 8, 64, BF16, True),
    (BF16, 65, 256, 4, 64, BF16, False),    # past QMM_MAX_ROWS
    (F32, 16, 256, 4, 64, F32, False),      # float32 activations
    (F16, 16, 256, 4, 64, BF16, False),     # activations not in the scales' dtype
    (BF16, 16, 320, 4, 64, BF16, False),    # K not in 128-chunks (4-bit)
    (BF16, 16, 96, 8, 32, BF16, False),     # K not in 64-chunks (8-bit)
]


@pytest.mark.parametrize("xd,rows,K,bits,gs,wd,taken", TAKES)
def test_which_calls_qmm_takes(xd, rows, K, bits, gs, wd, taken):
    assert qmm.takes(*_linear(xd, rows, K, bits, gs, wd)) is taken


@pytest.mark.parametrize("out, taken", [(65535 * 32, True), (65535 * 32 + 1, False)])   # grid y: 65535 blocks
def test_qmm_takes_weights_of_at_most_65535_row_blocks(out, taken):
    assert qmm.takes(*_linear(BF16, 9, 256, out=out)) is taken


NORM_CASES = [  # M, K, N, dtype: epi 1 with the next RMSNorm made by the last block of each 16 tokens
    (4, 256, 640, BF16),      # one token block over 20 weight blocks
    (20, 384, 96, F16),       # two token blocks, the second of 4 rows
    (33, 256, 4096, BF16),    # three, the last of 1 row; a hidden size of Qwen3-8B
    (4, 2560, 640, BF16),     # K over 16 warps: the norm's tail by a block of 16 warps
]


@pytest.mark.parametrize("M,K,N,dtype", NORM_CASES)
def test_qmm_normalised_output_is_rms_norm_of_its_output(M, K, N, dtype, on_gpu):
    """qmm(..., epi=1, norm=(weight, eps)): y as without the norm, bit for bit, and the norm's rows
    mx.fast.rms_norm(y) at its rounding points, up to the sum of squares' order (where the two
    inverse RMS part in their last bit, the two roundings after it may move by a unit each)."""
    wq, s, b = mx.quantize(mx.random.normal((N, K)) * 0.5, group_size=64, bits=4)
    w = PackedLinear(wq, s.astype(dtype), b.astype(dtype), None, (N,), K, 4, 64)
    x = mx.random.normal((M, K)).astype(dtype)
    res = (4 * mx.random.normal((M, N))).astype(dtype)
    nw = (1 + 0.2 * mx.random.normal((N,))).astype(dtype)
    cnt = mx.zeros((4,), dtype=mx.int32)
    y, yn = qmm.qmm(x, w, epi=1, res=res, norm=(nw, 1e-5), cnt=cnt)
    assert mx.array_equal(y, qmm.qmm(x, w, epi=1, res=res))
    want = to64(mx.fast.rms_norm(y, nw, 1e-5))
    got = to64(yn)
    assert (np.abs(got - want) <= 2 * ULP[dtype] * np.abs(want)).all()
    assert float((got == want).mean()) > 0.99
    assert (np.asarray(cnt) == 0).all()   # left zero for the next call


SHAPES = [  # K, N (weight rows), epi, head_dim (EPI 3): the benchmark models' projections, and wide heads
    (1024, 4096, 3, 128), (1024, 1024, 1, 0), (1024, 3072, 2, 0), (3072, 1024, 1, 0),   # Qwen3-0.6B
    (2560, 6144, 3, 128), (4096, 2560, 1, 0), (2560, 9728, 2, 0), (9728, 2560, 1, 0),   # Qwen3-4B
    (4096, 6144, 3, 128), (4096, 4096, 1, 0), (4096, 12288, 2, 0), (12288, 4096, 1, 0),  # Qwen3-8B
    (2048, 3072, 3, 64), (8192, 2048, 1, 0),                                             # Llama-3.2-1B
    (2560, 4096, 3, 256), (1024, 2048, 3, 256),          # head_dim 256: 8 + 2 x 4 and 4 + 2 x 2 heads
    (2560, 151936, 0, 0),                                # a vocabulary head
]


@pytest.mark.parametrize("K,N,epi,D", SHAPES)
def test_qmm_configs_fit_an_sm(K, N, epi, D):
    """Every row count's blocking launches: at most 16 warps (512 threads, the register file at 128
    registers a thread), a K chunk for every warp, and static shared memory (the warps' partials,
    the head epilogue's rows) within 48 KB. Fails before a GPU would refuse the launch."""
    for M in range(1, qmm.QMM_MAX_ROWS + 1):
        MT, NW, _, tokens = qmm.qmm_config(M, K, N // 2 if epi == 2 else N, 4, epi)
        smem = 4 * NW * 32 * 8 * MT + (4 * 8 * MT * D + 4 if epi == 3 else 0)
        assert NW <= qmm.SM_WARPS and NW <= K // qmm.chunk_k(4), (M, NW)
        assert smem <= 48 * 1024, (M, NW, MT, smem)
        assert tokens * 8 * MT >= M, (M, MT, tokens)
