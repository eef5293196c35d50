"""Every fused op against the stock composition it replaces, over a grid of shapes and dtypes.

On a machine with Metal or CUDA the ops run their GPU kernels (the backend MLX_FASTOPS_BACKEND
picks), so the same table checks those; here, on the CPU, it checks the reference path.
"""

import itertools

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.activations import swiglu
from mlx_lm.models.rope_utils import initialize_rope

from mlx_fastops import ops
from mlx_fastops.ops.weights import PackedLinear, RopeSpec

TOL = {mx.float32: 1e-5, mx.float16: 1e-2, mx.bfloat16: 2e-2}


def rel_err(a, b):
    a, b = np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32))
    assert np.isfinite(a).all(), "non-finite output"
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-6))


def make_linears(sizes, k, bits, group, dtype, bias=False, seed=0):
    mx.random.seed(seed)
    layers = []
    for n in sizes:
        lin = nn.Linear(k, n, bias=bias)
        if bias:
            lin.bias = mx.random.normal((n,))
        lin.set_dtype(dtype)
        layers.append(nn.QuantizedLinear.from_linear(lin, group, bits) if bits else lin)
    mx.eval([l.parameters() for l in layers])
    return layers


# (in_features, output splits): tile multiples and not.
LINEAR_SHAPES = [(128, (128, 64, 64)), (320, (96, 32, 32)), (192, (200, 40, 40))]
QUANT = [(None, None), (4, 32), (4, 64), (4, 128), (8, 32), (8, 64), (8, 128)]
DTYPES = [mx.float32, mx.float16, mx.bfloat16]


def linear_cases():
    for (k, splits), (bits, group), dtype in itertools.product(LINEAR_SHAPES, QUANT, DTYPES):
        if group and k % group:
            continue
        yield pytest.param(k, splits, bits, group, dtype, id=f"K{k}-{splits}-b{bits}-g{group}-{dtype}")


@pytest.mark.parametrize("k,splits,bits,group,dtype", list(linear_cases()))
@pytest.mark.parametrize("rows", [1, 3])
def test_qkv_proj(k, splits, bits, group, dtype, rows):
    layers = make_linears(splits, k, bits, group, dtype, bias=(k == 320))
    x = mx.random.normal((2, rows, k)).astype(dtype)
    expected = [l(x) for l in layers]
    w = PackedLinear.stack(layers)
    got = ops.qkv_proj(x, w)
    for g, e in zip(got, expected):
        assert g.shape == e.shape and g.dtype == e.dtype
        assert rel_err(g, e) <= TOL[dtype]
    # The stock modules now hold views into the stacked weights and still compute the same.
    for layer, e in zip(layers, expected):
        assert mx.array_equal(layer(x), e)


@pytest.mark.parametrize("k,splits,bits,group,dtype", list(linear_cases()))
def test_gate_up_silu(k, splits, bits, group, dtype):
    gate, up = make_linears((splits[0], splits[0]), k, bits, group, dtype, seed=1)
    x = mx.random.normal((1, 2, k)).astype(dtype)
    expected = swiglu(gate(x), up(x))
    got = ops.gate_up_silu(x, PackedLinear.stack([gate, up]))
    assert got.shape == expected.shape and rel_err(got, expected) <= TOL[dtype]


@pytest.mark.parametrize("bits,group", [(None, None), (4, 64), (8, 32), (4, 128)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_lm_head_tied(bits, group, dtype):
    emb = nn.Embedding(300, 256)
    emb.set_dtype(dtype)
    if bits:
        emb = nn.QuantizedEmbedding.from_embedding(emb, group, bits)
    x = mx.random.normal((1, 2, 256)).astype(dtype)
    expected = emb.as_linear(x)
    got = ops.lm_head(x, PackedLinear.from_embedding(emb))
    assert got.shape == (1, 2, 300) and rel_err(got, expected) <= TOL[dtype]


@pytest.mark.parametrize("hidden", [64, 1000, 1024])
@pytest.mark.parametrize("rows", [1, 4, 9])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_residual(hidden, rows, dtype):
    x = mx.random.normal((1, rows, hidden)).astype(dtype)
    res = (10 * mx.random.normal((1, rows, hidden))).astype(dtype)
    norm = nn.RMSNorm(hidden, eps=1e-6)
    norm.weight = mx.random.uniform(0.5, 1.5, (hidden,)).astype(dtype)
    h, n = ops.rms_norm_residual(x, res, norm.weight, 1e-6)
    assert rel_err(h, res + x) <= TOL[dtype]
    assert rel_err(n, norm(res + x)) <= TOL[dtype]


LLAMA3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
ROPES = [(64, False, 5e5, LLAMA3), (128, False, 1e6, None), (64, True, 1e4, None),
         (256, False, 1e6, {"type": "linear", "factor": 2.0})]


@pytest.mark.parametrize("dims,traditional,base,scaling", ROPES)
@pytest.mark.parametrize("with_norm", [True, False])
@pytest.mark.parametrize("offset,L", [(0, 1), (255, 1), (256, 3), (7, 300)])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_qk_norm_rope(dims, traditional, base, scaling, with_norm, offset, L, dtype):
    rope = initialize_rope(dims, base, traditional, scaling, 131072)
    spec = RopeSpec.from_module(rope)
    assert spec is not None
    q = mx.random.normal((2, L, 4, dims)).astype(dtype)
    k = mx.random.normal((2, L, 2, dims)).astype(dtype)
    qn, kn = nn.RMSNorm(dims, eps=1e-6), nn.RMSNorm(dims, eps=1e-6)
    qn.weight = mx.random.uniform(0.5, 1.5, (dims,)).astype(dtype)
    kn.weight = mx.random.uniform(0.5, 1.5, (dims,)).astype(dtype)
    if with_norm:
        eq, ek = qn(q), kn(k)
    else:
        eq, ek = q, k
    eq = rope(eq.transpose(0, 2, 1, 3), offset=offset)
    ek = rope(ek.transpose(0, 2, 1, 3), offset=offset)
    gq, gk = ops.qk_norm_rope(q, k, qn.weight if with_norm else None, kn.weight if with_norm else None,
                              1e-6, spec, offset)
    assert gq.shape == eq.shape and gk.shape == ek.shape
    assert rel_err(gq, eq) <= TOL[dtype] and rel_err(gk, ek) <= TOL[dtype]


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("gqa", [1, 2, 4, 8])
@pytest.mark.parametrize("length", [1, 255, 257])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_decode_attention(head_dim, gqa, length, dtype):
    B, hkv, alloc = 2, 2, 512
    q = mx.random.normal((B, hkv * gqa, 1, head_dim)).astype(dtype)
    kc = mx.random.normal((B, hkv, alloc, head_dim)).astype(dtype)
    vc = mx.random.normal((B, hkv, alloc, head_dim)).astype(dtype)
    scale = head_dim**-0.5
    expected = _sdpa_numpy(q, kc[..., :length, :], vc[..., :length, :], scale, causal=False)
    got = ops.decode_attention(q, kc, vc, length, scale)
    assert got.shape == expected.shape and rel_err(got, expected) <= TOL[dtype]


def _sdpa_numpy(q, k, v, scale, causal):
    q, k, v = (np.array(a.astype(mx.float32)) for a in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    s = q @ k.transpose(0, 1, 3, 2) * scale
    if causal:
        qL, kL = s.shape[-2], s.shape[-1]
        allowed = np.arange(kL)[None, :] <= np.arange(qL)[:, None] + (kL - qL)
        s = np.where(allowed, s, -np.inf)
    s = np.exp(s - s.max(-1, keepdims=True))
    return mx.array((s / s.sum(-1, keepdims=True)) @ v)


@pytest.mark.parametrize("head_dim,gqa", [(64, 1), (128, 2), (128, 4), (256, 8)])
@pytest.mark.parametrize("qL,kL", [(7, 7), (33, 33), (33, 290), (1, 1)])
@pytest.mark.parametrize("mask", [None, "causal"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_flash_attention(head_dim, gqa, qL, kL, mask, dtype):
    q = mx.random.normal((1, 2 * gqa, qL, head_dim)).astype(dtype)
    k = mx.random.normal((1, 2, kL, head_dim)).astype(dtype)
    v = mx.random.normal((1, 2, kL, head_dim)).astype(dtype)
    scale = head_dim**-0.5
    expected = _sdpa_numpy(q, k, v, scale, mask == "causal")
    got = ops.flash_attention(q, k, v, scale, mask)
    assert got.shape == q.shape and rel_err(got, expected) <= 2 * TOL[dtype] + 1e-4


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
    w = PackedLinear.stack(make_linears((64, 32, 32), 128, 4, 64, mx.float32))
    with pytest.raises(exc, match=words):
        call(w)


def test_unsupported_quantisation_is_named():
    layers = make_linears((64, 32, 32), 128, 3, 64, mx.float32)
    assert "bits=3" in PackedLinear.unsupported(layers)
    mixed = make_linears((64,), 128, 4, 64, mx.float32) + make_linears((32, 32), 128, 8, 64, mx.float32)
    assert "mixed bits" in PackedLinear.unsupported(mixed)
    lin = nn.Linear(128, 64)
    mx_ = nn.QuantizedLinear.from_linear(lin, 32, 4, mode="mxfp4")
    assert "mode" in PackedLinear.unsupported([mx_])


@pytest.mark.parametrize("head_dim,gqa", [(64, 2), (128, 4)])
@pytest.mark.parametrize("qL,kL,mask", [(1, 300, None), (33, 33, "causal"), (9, 260, "causal")])
@pytest.mark.parametrize("group_size", [32, 64])
def test_quantized_attention(head_dim, gqa, qL, kL, mask, group_size):
    from mlx_lm.models.base import quantized_scaled_dot_product_attention

    dtype = mx.float16
    q = mx.random.normal((1, 2 * gqa, qL, head_dim)).astype(dtype)
    keys = mx.quantize(mx.random.normal((1, 2, kL, head_dim)).astype(dtype), group_size=group_size, bits=8)
    values = mx.quantize(mx.random.normal((1, 2, kL, head_dim)).astype(dtype), group_size=group_size, bits=8)
    scale = head_dim**-0.5
    # mlx-lm's function scales its queries argument in place (`queries *= scale`): give each a copy.
    stock = quantized_scaled_dot_product_attention(mx.array(q), keys, values, scale=scale, mask=mask,
                                                   group_size=group_size, bits=8)
    got = ops.quantized_attention(mx.array(q), tuple(keys), tuple(values), scale, mask, group_size, 8)
    dk = mx.dequantize(*keys, group_size=group_size, bits=8)
    dv = mx.dequantize(*values, group_size=group_size, bits=8)
    exact = _sdpa_numpy(q, dk, dv, scale, mask == "causal")
    assert got.shape == q.shape and rel_err(got, exact) <= 2 * TOL[dtype]
    assert rel_err(got, stock) <= 2 * TOL[dtype]
