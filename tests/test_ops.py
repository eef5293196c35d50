"""Every fused op against the stock composition it replaces, one table of cases per op, on every backend.

The `backend` fixture (tests/conftest.py) runs each case on the reference path, on the Metal kernels
(the CPU emulator tests/metal_emu, or the GPU where Metal exists: `pytest -m metal`) and on the CUDA
kernels (the CPU emulator tests/cuda_emu, or the GPU: `pytest -m cuda`). Each backend is reached as
the patcher reaches it, through ops.select with the op's static shape class. A case the backend
refuses (its unsupported_<op> says why), or hands to the reference at run time (no kernel
launched: more than 8 rows, ...), is reported as skipped with the reason, after its result was
checked.

One metric: the relative max error, max |out - exact| / max |exact|, where `exact` is the stock
composition evaluated in float32 on the CPU. Stock in the inputs' own dtype is off by some amount
itself (MLX's CPU backend adds bf16 quantised matmuls up in bf16: 2-10% at these sizes; on a GPU
far less); a backend passes when it is at most TOL[dtype] further from exact than stock, the
fidelity standard of DESIGN.md ("at least as close to float32 as stock") with TOL the slack for
rounding at other points. Outputs start poisoned (the emulators do it; on a GPU the launches get
init_value=NaN): a non-finite output fails.
"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.activations import swiglu
from mlx_lm.models.base import quantized_scaled_dot_product_attention
from mlx_lm.models.cache import QuantizedKVCache
from mlx_lm.models.rope_utils import initialize_rope

from mlx_fastops import ops
from mlx_fastops.ops.weights import PackedLinear, RopeSpec

F32, F16, BF16 = mx.float32, mx.float16, mx.bfloat16
# About four units in the last place of each dtype; float32: RoPE's sin/cos of positions in the
# hundreds differ in their last bits (2e-5 at position 300).
TOL = {F32: 5e-5, F16: 2e-3, BF16: 1.6e-2}


def to64(a):
    return np.asarray(a.astype(F32)).astype(np.float64)


def rel_err(out, exact):
    out = to64(out)
    assert np.isfinite(out).all(), "non-finite output (an element no lane wrote is still poisoned)"
    return float(np.abs(out - exact).max() / max(np.abs(exact).max(), 1e-30))


def f32(a):
    return a.astype(F32) if isinstance(a, mx.array) and mx.issubdtype(a.dtype, mx.floating) else a


def same(a):
    return a


def check(backend, op, args, stock, dtype):
    """Run ops.<op>(*args) on `backend`; compare each output with stock(same) (stock in the inputs'
    dtype, this device) and stock(f32) (the exact value, on the CPU); skip where no kernel ran."""
    chosen, select = [], ops.select

    def spy(*a, **info):
        chosen.append(select(*a, **info))
        return chosen[-1]

    # Stock first. On MLX's CUDA backend some stock ops have no kernel (quantized_matmul at 8 bits,
    # mlx-lm's quantised-cache attention): the backend is then judged against the float32
    # composition alone, within TOL[dtype]; a backend that ran stock's op is skipped.
    try:
        ref = stock(same)
        mx.eval(ref)
    except RuntimeError as e:
        ref = None
        stock_fails = f"stock MLX cannot run this case on {mx.default_device()}: {str(e).splitlines()[0][:120]}"
    before = backend.launches
    ops.select = spy
    try:
        out = getattr(ops, op)(*args, backend=backend.name)
        mx.eval(out)
    except RuntimeError:
        if ref is not None or chosen[-1][1] != "reference":
            raise
        pytest.skip(stock_fails)
    finally:
        ops.select = select
    _, used, reason = chosen[-1]
    launched = backend.launches > before
    outs = list(out) if isinstance(out, tuple) else [out]
    with mx.stream(mx.cpu):
        exact = [to64(e) for e in stock(f32)]
    assert len(outs) == len(exact)
    for i, (o, e) in enumerate(zip(outs, exact)):
        shape, dt = (ref[i].shape, ref[i].dtype) if ref is not None else (e.shape, dtype)
        assert o.shape == shape and o.dtype == dt, (i, o.shape, shape, o.dtype, dt)
        err, stock_err = rel_err(o, e), (rel_err(ref[i], e) if ref is not None else 0.0)
        assert err <= stock_err + TOL[dtype], f"output {i}: error {err:.2e}, stock's {stock_err:.2e}"
    if used != backend.name:
        pytest.skip(f"{backend.name} refuses this case: {reason}")
    if backend.name != "reference" and not launched:
        pytest.skip(f"{backend.name}.{op} launched no kernel for this call (it ran MLX ops)")
    return outs


@pytest.fixture(autouse=True)
def _seed():
    mx.random.seed(0)


def rand(shape, dtype, scale=1.0):
    return (scale * mx.random.normal(shape)).astype(dtype)


def ids(case):
    return "-".join(str(v).replace("mlx.core.", "").replace(" ", "") for v in case)


# ---------------------------------------------------------------------------------------------
# the linear ops: qkv_proj, gate_up_silu, lm_head, linear


def layers(sizes, k, bits, group, dtype, bias=False, tied=False):
    """The stock layers a fused op replaces (nn.Linear / nn.QuantizedLinear, or the embedding of a
    tied lm_head), with N(0, 0.5) weights."""
    out = []
    for n in sizes:
        if tied:
            m = nn.Embedding(n, k)
            m.weight = rand((n, k), F32, 0.5)
        else:
            m = nn.Linear(k, n, bias=bias)
            m.weight = rand((n, k), F32, 0.5)
            if bias:
                m.bias = rand((n,), F32)
        m.set_dtype(dtype)
        if bits:
            m = (nn.QuantizedEmbedding.from_embedding if tied else nn.QuantizedLinear.from_linear)(m, group, bits)
            assert (np.asarray(m.scales.astype(F32)) < 0).any(), "the case must include negative scales"
        out.append(m)
    mx.eval([m.parameters() for m in out])
    return out


def stock_linear(m, x, cast):
    """nn.Linear / nn.QuantizedLinear / Embedding.as_linear, with every float array cast."""
    if "scales" in m:
        y = mx.quantized_matmul(cast(x), m.weight, cast(m.scales), cast(m.biases), transpose=True,
                                group_size=m.group_size, bits=m.bits)
        return y + cast(m.bias) if "bias" in m else y
    if "bias" in m:
        return mx.addmm(cast(m.bias), cast(x), cast(m.weight).T)
    return cast(x) @ cast(m.weight).T


# Metal: 8 weight rows a threadgroup, K in blocks of 512 (4-bit) / 256 (8-bit) values, row buckets
# 1/2/4/8; N and K below are chosen around those (N not a multiple of 8, K inside one block, one
# block + a tail, two or more).
QKV = [  # K, (Nq, Nk, Nv), bits, group, dtype, x [B, L], bias
    (128, (128, 64, 64), None, None, F32, (1, 1), False),   # float weights
    (320, (96, 32, 32), None, None, BF16, (3, 1), True),
    (320, (129, 33, 33), 4, 32, F16, (1, 1), False),
    (640, (136, 40, 40), 4, 64, BF16, (1, 2), True),
    (1152, (64, 16, 16), 4, 128, F16, (4, 1), False),
    (384, (72, 24, 24), 8, 32, BF16, (1, 5), False),
    (512, (129, 33, 33), 8, 64, F16, (8, 1), True),
    (256, (64, 16, 16), 8, 128, BF16, (1, 7), False),
    (320, (96, 32, 32), 4, 64, F32, (1, 2), False),         # float32 activations
    (320, (96, 32, 32), 4, 64, F16, (1, 9), False),         # more rows than the decode kernels take
    (512, (129, 33, 33), 4, 32, BF16, (3, 11), True),       # CUDA: tensor cores (9-64 rows)
    (256, (64, 16, 16), 8, 128, F16, (2, 32), False),       # CUDA: 64 rows, the most it takes
]


@pytest.mark.parametrize("k,splits,bits,group,dtype,rows,bias", QKV, ids=[ids(c) for c in QKV])
def test_qkv_proj(backend, k, splits, bits, group, dtype, rows, bias):
    mods = layers(splits, k, bits, group, dtype, bias)
    x = rand((*rows, k), dtype)
    check(backend, "qkv_proj", (x, PackedLinear.stack(mods)),
          lambda cast: [stock_linear(m, x, cast) for m in mods], dtype)


GATE_UP = [  # K, intermediate, bits, group, dtype, x [B, L], bias
    (128, 64, None, None, F16, (1, 2), False),
    (320, 37, 4, 32, BF16, (1, 1), False),        # Metal: 4 outputs a threadgroup
    (640, 66, 4, 64, F16, (3, 1), True),          # CUDA takes no bias on gate/up
    (1152, 129, 4, 128, BF16, (1, 4), False),
    (384, 37, 8, 32, F16, (1, 6), False),
    (512, 66, 8, 64, BF16, (8, 1), False),
    (256, 129, 8, 128, F16, (1, 3), True),
    (320, 64, 4, 64, F32, (1, 2), False),
    (256, 40, 8, 64, BF16, (2, 8), False),         # 16 rows (CUDA: tensor cores)
    (384, 37, 4, 128, F16, (1, 57), False),        # CUDA: 8 token tiles, the last of 1 row
    (128, 4097, 4, 32, F16, (1, 1), False),        # CUDA: 2 rows a warp from 4096 outputs
]


@pytest.mark.parametrize("k,inter,bits,group,dtype,rows,bias", GATE_UP, ids=[ids(c) for c in GATE_UP])
def test_gate_up_silu(backend, k, inter, bits, group, dtype, rows, bias):
    gate, up = layers((inter, inter), k, bits, group, dtype, bias)
    x = rand((*rows, k), dtype)
    check(backend, "gate_up_silu", (x, PackedLinear.stack([gate, up])),
          lambda cast: [swiglu(stock_linear(gate, x, cast), stock_linear(up, x, cast))], dtype)


LM_HEAD = [  # K, vocab, bits, group, dtype, x [B, L], tied (the embedding as the output layer)
    (256, 300, None, None, F32, (1, 2), True),
    (256, 300, 4, 64, BF16, (1, 1), True),
    (320, 141, 4, 32, F16, (2, 1), False),
    (384, 77, 8, 32, BF16, (1, 5), False),
    (1024, 1000, 8, 128, F16, (1, 8), False),
    (512, 203, 4, 128, BF16, (1, 3), False),
    (256, 300, 8, 64, F16, (1, 12), True),        # CUDA: tensor cores (9-64 rows)
    (512, 1001, 4, 64, BF16, (2, 16), True),      # CUDA: tensor cores, vocab past the last 32-row block
    (256, 4099, 4, 64, F16, (1, 2), False),       # CUDA: 2 rows a warp from 4096 outputs
]


@pytest.mark.parametrize("k,vocab,bits,group,dtype,rows,tied", LM_HEAD, ids=[ids(c) for c in LM_HEAD])
def test_lm_head(backend, k, vocab, bits, group, dtype, rows, tied):
    (m,) = layers((vocab,), k, bits, group, dtype, tied=tied)
    w = PackedLinear.from_embedding(m) if tied else PackedLinear.stack([m])
    x = rand((*rows, k), dtype)
    check(backend, "lm_head", (x, w), lambda cast: [stock_linear(m, x, cast)], dtype)


LINEAR = [  # K, N, bits, group, dtype, x [B, L], bias: o_proj / down_proj shapes
    (128, 96, None, None, F32, (1, 1), False),
    (320, 136, 4, 32, BF16, (1, 1), True),
    (1152, 129, 4, 128, F16, (2, 3), False),
    (384, 64, 8, 64, BF16, (1, 8), False),
    (256, 72, 4, 64, F16, (1, 13), False),        # more rows than the decode kernels take (CUDA: tensor cores)
    (640, 136, 8, 32, BF16, (5, 9), True),        # CUDA: tensor cores, 8-bit, bias
    (320, 72, 4, 64, F16, (1, 20), False),        # CUDA: K not in 128-chunks, stock quantized_matmul
    (320, 136, 4, 32, BF16, (1, 600), True),      # CUDA's prefill path (dense matmul, no kernel of ours)
]


@pytest.mark.parametrize("k,n,bits,group,dtype,rows,bias", LINEAR, ids=[ids(c) for c in LINEAR])
def test_linear(backend, k, n, bits, group, dtype, rows, bias):
    (m,) = layers((n,), k, bits, group, dtype, bias)
    x = rand((*rows, k), dtype)
    check(backend, "linear", (x, PackedLinear.stack([m])), lambda cast: [stock_linear(m, x, cast)], dtype)


# ---------------------------------------------------------------------------------------------
# norms and RoPE

NORM = [  # hidden, x [B, L], dtype
    (33, (1, 1), F32), (96, (1, 5), F16), (1000, (4, 1), BF16), (1024, (1, 2), BF16),
    (2560, (1, 7), F16), (4096, (2, 1), BF16), (1024, (1, 9), F16),
]


@pytest.mark.parametrize("hidden,rows,dtype", NORM, ids=[ids(c) for c in NORM])
def test_rms_norm_residual(backend, hidden, rows, dtype):
    x = rand((*rows, hidden), dtype, 3.0)
    res = rand((*rows, hidden), dtype, 10.0)
    w = mx.random.uniform(0.5, 1.5, (hidden,)).astype(dtype)
    h, _ = check(backend, "rms_norm_residual", (x, res, w, 1e-6),
                 lambda cast: [cast(res) + cast(x), mx.fast.rms_norm(cast(res) + cast(x), cast(w), 1e-6)], dtype)
    # h is the residual stream every later layer adds to: the stock add, bit for bit
    assert mx.array_equal(h, res + x)


SCALING = {None: None, "linear2": {"type": "linear", "factor": 2.0},
           "llama3": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192}}

QK_NORM_ROPE = [  # head_dim, RoPE (dims, traditional, base, scaling), norm, [B, L], (H, Hkv), offset, dtype
    (128, (128, False, 1e6, None), True, (1, 1), (16, 8), 37, BF16),    # Qwen3-0.6B decode
    (128, (128, False, 1e6, None), True, (1, 5), (4, 2), 0, F16),       # prefill
    (64, (64, False, 5e5, "llama3"), False, (2, 3), (8, 1), 255, BF16), # Llama-3 freqs, across 256
    (64, (64, True, 1e4, None), True, (1, 2), (2, 2), 11, BF16),        # traditional
    (128, (32, True, 1e4, None), False, (1, 2), (2, 1), 3, F16),        # traditional, partial
    (256, (128, False, 1e4, "linear2"), True, (1, 2), (4, 2), 256, F16), # partial, scaled positions
    (128, (128, False, 5e5, "llama3"), True, (1, 1), (4, 2), 8191, F16),
    (64, (64, False, 1e4, None), True, (1, 300), (2, 1), 7, F32),       # 300-token prompt
    (128, (128, False, 1e6, None), True, (1, 1), (4, 2), "array", F16),  # offset as an mx.array
    (96, (96, False, 1e4, None), True, (1, 1), (2, 1), 5, F16),         # head_dim 96: no kernel
]


@pytest.mark.parametrize("D,rope,norm,shape,heads,offset,dtype", QK_NORM_ROPE, ids=[ids(c) for c in QK_NORM_ROPE])
def test_qk_norm_rope(backend, D, rope, norm, shape, heads, offset, dtype):
    dims, traditional, base, scaling = rope
    rope = initialize_rope(dims, base, traditional, SCALING[scaling], 131072)
    (B, L), (H, Hk) = shape, heads
    offset = mx.array(17) if offset == "array" else offset
    # q and k as the patcher hands them over: views of one fused QKV output
    qkv = rand((B, L, (H + 2 * Hk) * D), dtype, 2.0)
    q = qkv[..., :H * D].reshape(B, L, H, D)
    k = qkv[..., H * D:(H + Hk) * D].reshape(B, L, Hk, D)
    qn = mx.random.uniform(0.5, 1.5, (D,)).astype(dtype) if norm else None
    kn = mx.random.uniform(0.5, 1.5, (D,)).astype(dtype) if norm else None

    def stock(cast):
        a, b = cast(q), cast(k)
        if norm:
            a, b = mx.fast.rms_norm(a, cast(qn), 1e-6), mx.fast.rms_norm(b, cast(kn), 1e-6)
        return [rope(a.transpose(0, 2, 1, 3), offset=offset), rope(b.transpose(0, 2, 1, 3), offset=offset)]

    check(backend, "qk_norm_rope", (q, k, qn, kn, 1e-6, RopeSpec.from_module(rope), offset), stock, dtype)


# ---------------------------------------------------------------------------------------------
# attention


def sdpa(cast, q, k, v, scale, mask=None):
    return [mx.fast.scaled_dot_product_attention(cast(q), cast(k), cast(v), scale=scale, mask=mask)]


# "strided": the cache buffers are views into a larger array (the kernels index by strides)
DECODE = [  # head_dim, GQA group, B, Hkv, length, cache slots, dtype, strided
    (64, 1, 1, 2, 1, 256, BF16, ""),
    (64, 2, 1, 2, 255, 256, F16, "strided"),
    (64, 4, 2, 2, 257, 512, BF16, ""),
    (64, 8, 1, 2, 1000, 1024, F16, ""),          # split over chunks
    (128, 1, 2, 2, 64, 1024, BF16, "strided"),
    (128, 2, 1, 8, 300, 512, F16, ""),           # Qwen3-0.6B
    (128, 4, 1, 2, 3000, 4096, BF16, ""),
    (128, 8, 1, 2, 257, 512, BF16, "strided"),
    (256, 1, 1, 2, 33, 256, F16, ""),
    (256, 2, 1, 2, 256, 256, BF16, ""),
    (256, 4, 2, 1, 129, 256, F16, ""),
    (256, 8, 1, 1, 400, 512, BF16, ""),
    (64, 7, 1, 2, 77, 256, BF16, ""),            # Qwen2.5-0.5B's group of 7
    (128, 3, 2, 2, 129, 256, F16, "strided"),
    (64, 2, 1, 2, 77, 256, F32, ""),
    (96, 2, 1, 2, 40, 256, F16, ""),             # head_dim 96: no kernel
]


@pytest.mark.parametrize("D,G,B,Hk,length,slots,dtype,how", DECODE, ids=[ids(c) for c in DECODE])
def test_decode_attention(backend, D, G, B, Hk, length, slots, dtype, how):
    q = rand((B, 1, Hk * G, D), dtype).transpose(0, 2, 1, 3)   # mlx-lm's [B, L, H, D] -> [B, H, L, D] view
    pad = 16 if how == "strided" else 0
    kv = rand((2, B, Hk, slots + pad, D), dtype)
    # cache slots past the valid length hold NaN: a kernel must not read them
    kv = mx.where(mx.arange(slots + pad).reshape(1, 1, 1, -1, 1) < pad + length, kv, mx.array(float("nan"), dtype))
    kc, vc = kv[0, :, :, pad:], kv[1, :, :, pad:]
    scale = D ** -0.5
    check(backend, "decode_attention", (q, kc, vc, length, scale),
          lambda cast: sdpa(cast, q, kc[..., :length, :], vc[..., :length, :], scale), dtype)


FLASH = [  # head_dim, GQA group, B, Hkv, query tokens, keys, mask, dtype
    (64, 1, 1, 2, 7, 7, "causal", F16),
    (64, 2, 1, 1, 1, 1, "causal", BF16),
    (128, 2, 1, 1, 33, 33, "causal", BF16),
    (128, 8, 1, 2, 9, 41, "causal", F16),       # a prompt continued after 32 cached tokens
    (256, 4, 1, 1, 33, 290, "causal", BF16),    # after 257 cached tokens
    (64, 2, 1, 2, 33, 20, None, F16),           # no mask, fewer keys than queries
    (128, 1, 2, 2, 18, 18, "causal", F32),
    (64, 3, 1, 1, 12, 12, "causal", F16),
    (64, 1, 1, 1, 257, 257, "causal", F16),     # 17 query tiles
    (64, 2, 1, 1, 5, 9, "array", F16),          # an array mask: no kernel
]


@pytest.mark.parametrize("D,G,B,Hk,qL,kL,mask,dtype", FLASH, ids=[ids(c) for c in FLASH])
def test_flash_attention(backend, D, G, B, Hk, qL, kL, mask, dtype):
    q = rand((B, qL, Hk * G, D), dtype).transpose(0, 2, 1, 3)
    # k/v as KVCache.update_and_fetch returns them: slices of 256-slot buffers
    slots = 256 * -(-kL // 256)
    k, v = rand((B, Hk, slots, D), dtype)[..., :kL, :], rand((B, Hk, slots, D), dtype)[..., :kL, :]
    if mask == "array":
        mask = mx.random.uniform(shape=(qL, kL)) > 0.3
    scale = D ** -0.5
    check(backend, "flash_attention", (q, k, v, scale, mask), lambda cast: sdpa(cast, q, k, v, scale, mask), dtype)


# CUDA: decode (up to 8 query tokens) is a kernel over the packed cache, split over the sequence
# (lengths not multiples of the 16-position split step); longer prompts dequantise, then SDPA.
QUANT_ATTENTION = [  # head_dim, GQA group, B, query tokens, cached tokens before them, group size, bits, dtype
    (64, 2, 1, 9, 0, 64, 8, F16),
    (128, 1, 1, 5, 20, 32, 8, BF16),    # CUDA: 5 causal query rows in the decode kernel
    (256, 4, 1, 17, 3, 64, 8, F16),
    (128, 8, 1, 33, 0, 128, 8, BF16),
    (128, 2, 1, 1, 299, 64, 8, F16),    # decode after 299 cached tokens
    (128, 2, 1, 9, 0, 64, 4, F16),      # a 4-bit cache (Metal: no kernel)
    (64, 8, 1, 1, 6, 64, 4, F16),       # 7 positions: one split
    (64, 1, 2, 1, 16, 32, 4, BF16),     # batch 2, 17 positions
    (64, 4, 1, 1, 256, 64, 8, F16),     # across the cache's 256-slot growth step
    (128, 4, 1, 1, 999, 32, 8, BF16),   # many splits
    (128, 8, 1, 1, 510, 64, 4, BF16),
    (256, 2, 1, 1, 77, 128, 4, F16),
    (128, 4, 2, 3, 300, 64, 4, BF16),   # 3 causal query rows, batch 2
    (128, 2, 1, 1, 40, 64, 8, F32),
    (96, 2, 1, 1, 40, 32, 8, F16),      # head_dim 96: no kernel
    (128, 2, 1, 1, 40, 64, 2, F16),     # a 2-bit cache: no kernel
]


@pytest.mark.parametrize("D,G,B,qL,cached,group,bits,dtype", QUANT_ATTENTION, ids=[ids(c) for c in QUANT_ATTENTION])
def test_quantized_attention(backend, D, G, B, qL, cached, group, bits, dtype):
    kL, Hk = cached + qL, 2
    k, v = rand((B, Hk, kL, D), dtype), rand((B, Hk, kL, D), dtype)
    q = rand((B, Hk * G, qL, D), dtype)
    cache = QuantizedKVCache(group_size=group, bits=bits)
    if cached:
        cache.update_and_fetch(k[..., :cached, :], v[..., :cached, :])
    qk, qv = cache.update_and_fetch(k[..., cached:, :], v[..., cached:, :])  # strided slices of its buffers
    mask = "causal" if qL > 1 else None
    scale = D ** -0.5

    def stock(cast):
        # mlx-lm's function scales its queries argument in place: give it a copy
        return [quantized_scaled_dot_product_attention(
            mx.array(cast(q)), tuple(map(cast, qk)), tuple(map(cast, qv)), scale=scale, mask=mask,
            group_size=group, bits=bits)]

    check(backend, "quantized_attention", (mx.array(q), tuple(qk), tuple(qv), scale, mask, group, bits),
          stock, dtype)


# ---------------------------------------------------------------------------------------------
# backend-independent: input validation, what cannot be stacked, the stock modules after stacking

BAD_CALLS = [
    ("int activations", lambda w: ops.qkv_proj(mx.zeros((1, 1, 128), mx.int32), w), TypeError, "float16"),
    ("wrong in size", lambda w: ops.qkv_proj(mx.zeros((1, 1, 64)), w), ValueError, "features"),
    ("numpy input", lambda w: ops.qkv_proj(np.zeros((1, 1, 128)), w), TypeError, "mx.array"),
    ("not packed", lambda w: ops.qkv_proj(mx.zeros((1, 1, 128)), w.weight), TypeError, "PackedLinear"),
    ("gate_up splits", lambda w: ops.gate_up_silu(mx.zeros((1, 1, 128)), w), ValueError, "2 equal"),
    ("residual shape", lambda w: ops.rms_norm_residual(mx.zeros((1, 2, 8)), mx.zeros((1, 1, 8)),
                                                        mx.ones((8,)), 1e-6), ValueError, "shape"),
    ("cache length", lambda w: ops.decode_attention(mx.zeros((1, 2, 1, 64)), mx.zeros((1, 1, 8, 64)),
                                                    mx.zeros((1, 1, 8, 64)), 9, 1.0), ValueError, "length"),
    ("heads", lambda w: ops.flash_attention(mx.zeros((1, 3, 4, 64)), mx.zeros((1, 2, 4, 64)),
                                            mx.zeros((1, 2, 4, 64)), 1.0), ValueError, "multiple"),
    ("mask", lambda w: ops.flash_attention(mx.zeros((1, 2, 4, 64)), mx.zeros((1, 2, 4, 64)),
                                           mx.zeros((1, 2, 4, 64)), 1.0, "top-left"), ValueError, "causal"),
]


@pytest.mark.parametrize("name,call,exc,words", BAD_CALLS, ids=[b[0] for b in BAD_CALLS])
def test_bad_input_raises_clear_error(name, call, exc, words):
    w = PackedLinear.stack(layers((64, 32, 32), 128, 4, 64, F32))
    with pytest.raises(exc, match=words):
        call(w)


def test_unsupported_quantisation_is_named():
    assert "bits=3" in PackedLinear.unsupported(layers((64, 32, 32), 128, 3, 64, F32))
    mixed = layers((64,), 128, 4, 64, F32) + layers((32, 32), 128, 8, 64, F32)
    assert "mixed bits" in PackedLinear.unsupported(mixed)
    assert "mode" in PackedLinear.unsupported([nn.QuantizedLinear.from_linear(nn.Linear(128, 64), 32, 4, mode="mxfp4")])


@pytest.mark.parametrize("bits", [None, 4])
def test_stacked_modules_still_compute_the_same(bits):
    """PackedLinear.stack rebinds the stock modules to views of the stacked arrays (unpatch and the
    paths left stock use them): they compute what they did, bit for bit."""
    mods = layers((96, 32, 32), 320, bits, 64, BF16, bias=True)
    x = rand((1, 3, 320), BF16)
    before = [m(x) for m in mods]
    PackedLinear.stack(mods)
    for m, b in zip(mods, before):
        assert mx.array_equal(m(x), b)
