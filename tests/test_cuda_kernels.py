"""The CUDA kernels' own paths, beyond the op table of tests/test_ops.py: the GEMV (x staged or not,
its epilogues, the folded norm), the QKV head epilogue, decode attention and the fast decode path
of tiny models, on fresh random inputs. The one-launch layer: tests/test_cuda_layer.py; layers per
launch and the phase stamps: tests/test_cuda_launches.py.

On a machine with MLX's CUDA backend the kernels run on the GPU (`pytest -m cuda`). Everywhere else
the same tests run the same wrappers through the CPU emulator of tests/cuda_emu (CUDA-emulator-
verified: logic, indexing, barriers and shuffles; not timing or inter-block races).
"""

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_fastops import kernels
from mlx_fastops.backends.cuda import attention as A
from mlx_fastops.backends.cuda import gemv as G
from mlx_fastops.backends.cuda.source import offset_array, tickets
from mlx_fastops.backends import reference as R
from mlx_fastops.ops.weights import PackedLinear, RopeSpec

from cuda_checks import ON_GPU, rel, unstaged

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("on_gpu")]   # on_gpu: the GPU, else the emulator

def packed(N, K, bits, gs, dtype, splits=None, bias=False):
    w = mx.random.normal((N, K)) * 0.05
    wq, s, b = mx.quantize(w, group_size=gs, bits=bits)
    return PackedLinear(wq, s.astype(dtype), b.astype(dtype),
                        (0.1 * mx.random.normal((N,))).astype(dtype) if bias else None,
                        tuple(splits or (N,)), K, bits, gs)


def dense(w):
    """fp32 dequantised weight [N, K] (from the stored, already rounded scales/biases)."""
    return mx.dequantize(w.weight, w.scales.astype(mx.float32), w.biases.astype(mx.float32),
                         group_size=w.group_size, bits=w.bits)


@pytest.mark.parametrize("dtype,bits,gs,M,K,N,xt", [
    ("bfloat16", 4, 64, 1, 1024, 4096, 0), ("float16", 8, 32, 2, 320, 200, 0), ("bfloat16", 4, 128, 3, 1024, 1032, 0),
    ("bfloat16", 8, 64, 4, 896, 4864, 0),
    # staged as T values: Qwen3-4B's QKV at 4 rows, 8-bit at 3 rows (4 k per lane-step), 8 rows
    ("bfloat16", 4, 64, 4, 2560, 1000, 1), ("float16", 8, 32, 3, 1536, 200, 1), ("bfloat16", 4, 128, 8, 1024, 300, 1)])
def test_gemv_staged_x_keeps_bits(dtype, bits, gs, M, K, N, xt):
    """x converted once per block into shared memory (as floats, or as T values converted at each
    k-step) or per warp at each k-step: the same values in the same order, so the same bits
    (tests/test_ops.py checks the values against float32)."""
    dt = getattr(mx, dtype)
    w = packed(N, K, bits, gs, dt, bias=(M == 2))
    x = mx.random.normal((M, K)).astype(dt)
    assert G.x_stage(M, K, dt, bits, G.gemv_config(M, K, N, bits, 0)[0]) == (K, xt)
    y = G.gemv(x, w)
    with unstaged():
        assert mx.array_equal(y, G.gemv(x, w))


@pytest.mark.parametrize("M,K,N,gs", [(1, 1024, 300, 64), (3, 448, 200, 32), (8, 2048, 72, 128)])
def test_folded_nibbles_are_exact_to_a_bit_or_two(M, K, N, gs):
    """4-bit weights as 0.5 + q/32 (the offset taken out with the x-sum) lose a bit or two to
    cancellation: in float32 within 1e-5 of a float64 product (emulator: 2e-6), three orders inside
    the 1e-2 tolerances that a wrong offset would still have to beat."""
    w = packed(N, K, 4, gs, mx.float32)
    x = 3 * mx.random.normal((M, K)) + 1   # a mean, so the folded x-sum is not ~0
    exact = np.asarray(x).astype(np.float64) @ np.asarray(dense(w)).astype(np.float64).T
    y = np.asarray(G.gemv(x, w)).astype(np.float64)
    assert np.linalg.norm(y - exact) / np.linalg.norm(exact) < 1e-5


@pytest.mark.parametrize("dtype,bits,gs,M", [("bfloat16", 4, 64, 1), ("float16", 8, 32, 2),
                                             ("bfloat16", 4, 128, 5), ("bfloat16", 8, 64, 8)])
def test_gemv_epilogues(dtype, bits, gs, M):
    dt = getattr(mx, dtype)
    K, N = 1024, 704
    x = mx.random.normal((M, K)).astype(dt)
    # residual
    w = packed(N, K, bits, gs, dt)
    res = mx.random.normal((M, N)).astype(dt)
    y = G.gemv(x, w, epi=1, res=res)
    assert rel(y, (res.astype(mx.float32) + x.astype(mx.float32) @ dense(w).T)) < 1e-2
    with unstaged():
        assert mx.array_equal(y, G.gemv(x, w, epi=1, res=res))
    # gate/up + SiLU with folded RMSNorm
    gu = packed(2 * N, K, bits, gs, dt, splits=(N, N))
    nw = (1 + 0.1 * mx.random.normal((K,))).astype(dt)
    y = G.gemv(x * 3, gu, epi=2, norm=(nw, 1e-6))
    xn = mx.fast.rms_norm(x * 3, nw, 1e-6)
    g, u = mx.split(xn.astype(mx.float32) @ dense(gu).T, 2, axis=-1)
    exact = nn.silu(g) * u
    assert rel(y, exact) < 1.5e-2
    if ON_GPU:
        assert rel(y, R.gate_up_silu(xn, gu)) < 3e-2
    # public op wrappers
    assert rel(G.gate_up_silu(xn.reshape(1, M, K), gu), exact.reshape(1, M, N)) < 1.5e-2
    qkv = packed(N + 128 + 128, K, bits, gs, dt, splits=(N, 128, 128))
    full = x.astype(mx.float32) @ dense(qkv).T
    for a, b in zip(G.qkv_proj(x.reshape(M, 1, K), qkv), mx.split(full, [N, N + 128], axis=-1)):
        assert a.shape == (M, 1, b.shape[-1]) and rel(a, b.reshape(M, 1, -1)) < 1e-2


@pytest.mark.parametrize("dtype,M,K", [("bfloat16", 1, 1024), ("bfloat16", 3, 896), ("float16", 2, 4096),
                                       ("float16", 8, 320), ("bfloat16", 1, 4096), ("float16", 4, 1024)])
def test_folded_norm_matches_rms_norm(dtype, M, K):
    """The GEMV's folded input RMSNorm has mx.fast.rms_norm's rounding points: the same GEMV on
    rms_norm's output agrees bit for bit (emulator: 0.0 over 360 draws) where the sum of squares
    is exact in float32 whatever its order (x in quarters up to 3). With x = 3 * normal, the two
    sums of squares, added in different orders, can differ in their last bit: then ~1% of the
    normalized elements move by an ulp and up to ~40% of the bf16 outputs differ (rel above 2e-3
    in 5 of 360 draws, at most 2.9e-3), nearly as much as a norm that misses 8 of K elements
    (3.6e-3 to 6.3e-3; the 1e-2 tolerances against float32 would let that pass). Where x fits in
    shared memory (staged) the norm gives the unstaged one's bits."""
    dt = getattr(mx, dtype)
    x = (mx.random.randint(-12, 13, (M, K)) / 4).astype(dt)
    nw = (1 + 0.1 * mx.random.normal((K,))).astype(dt)
    gu = packed(640, K, 4, 64, dt, splits=(320, 320))
    y = G.gemv(x, gu, epi=2, norm=(nw, 1e-6))
    assert rel(y, G.gemv(mx.fast.rms_norm(x, nw, 1e-6), gu, epi=2)) < 1e-3
    assert G.x_stage(M, K, dt, 4, G.gemv_config(M, K, 640, 4, 2)[0]) == (K, int(M * K > G.STAGE_MAX_FLOATS))
    with unstaged():
        assert mx.array_equal(y, G.gemv(x, gu, epi=2, norm=(nw, 1e-6)))


def _rope_ref(x, rope, offset):
    return mx.fast.rope(x, rope.dims, traditional=rope.traditional, base=rope.base, scale=rope.scale,
                        offset=offset, freqs=rope.freqs)


@pytest.mark.parametrize("D,H,HKV,M,L,qknorm,freqs,bias", [
    (128, 16, 8, 1, 1, True, False, False),     # qwen3-0.6b
    (128, 32, 8, 2, 1, True, False, False),     # qwen3-4b, batch 2
    (64, 4, 1, 1, 1, False, True, False),       # llama (llama3 rope freqs)
    (64, 14, 2, 2, 1, False, False, True),      # qwen2 (bias), batch 2
    (128, 8, 8, 4, 4, True, False, False),      # 4 new tokens
    (256, 8, 4, 2, 1, True, False, False),
    (64, 8, 2, 8, 1, False, False, True),
])
def test_head_kernel(D, H, HKV, M, L, qknorm, freqs, bias):
    dt = mx.bfloat16
    K, B = 1024, M // L
    qkv = packed((H + 2 * HKV) * D, K, 4, 64, dt, splits=(H * D, HKV * D, HKV * D), bias=bias)
    x = mx.random.normal((B, L, K)).astype(dt)
    nw = (1 + 0.1 * mx.random.normal((K,))).astype(dt)
    qn = (1 + 0.1 * mx.random.normal((D,))).astype(dt)
    kn = (1 + 0.1 * mx.random.normal((D,))).astype(dt)
    if freqs:
        rope = RopeSpec(D, False, None, 1.0, (500000.0 ** (mx.arange(0, D, 2) / D)).astype(mx.float32))
    else:
        rope = RopeSpec(D, False, 1000000.0, 1.0)
    S, off = 512, 300
    kc = mx.random.normal((B, HKV, S, D)).astype(dt)
    vc = mx.random.normal((B, HKV, S, D)).astype(dt)
    kc0, vc0 = kc + 0, vc + 0
    mx.eval(kc, vc, kc0, vc0)
    head = (("D", D), ("H", H), ("HKV", HKV), ("freqs", freqs), ("keps", 1e-5),
            ("log2_base", math.log2(rope.base or 1.0)), ("qeps", 1e-6), ("qknorm", qknorm), ("scale", 1.0),
            ("trad", False), ("L", L))
    kern, grid, tg = G.gemv_kernel(dt, M, K, qkv.out_features, 4, 64, 3, 1e-6, bias, False, head)
    ins = [x, qkv.weight, qkv.scales, qkv.biases, nw] + ([qkv.bias] if bias else [])
    ins += ([qn, kn] if qknorm else []) + [offset_array(off)]
    cnt = tickets(H + 2 * HKV)
    ins += ([rope.freqs] if freqs else []) + [kc, vc, cnt, kc]
    # twice: the tickets must be back to zero after each launch
    for _ in range(2):
        q = kern(inputs=ins, output_shapes=[(B, L, H, D), (M, qkv.out_features)], output_dtypes=[dt, mx.float32],
                 grid=grid, threadgroup=tg)[0]
        mx.eval(q)
        assert not np.asarray(cnt).any()
    # reference: the kernel's rounding points (GEMV in float32 -> T), then stock norm and RoPE ops
    xn = mx.fast.rms_norm(x, nw, 1e-6)
    y = xn.astype(mx.float32) @ dense(qkv).T
    if bias:
        y = y.astype(dt).astype(mx.float32) + qkv.bias.astype(mx.float32)
    rq, rk, rv = mx.split(y.astype(dt), [H * D, (H + HKV) * D], axis=-1)
    rq, rk = rq.reshape(B, L, H, D), rk.reshape(B, L, HKV, D)
    if qknorm:
        rq, rk = mx.fast.rms_norm(rq, qn, 1e-6), mx.fast.rms_norm(rk, kn, 1e-5)
    rq, rk = R.qk_norm_rope(rq, rk, None, None, 1e-6, rope, off)
    rv = rv.reshape(B, L, HKV, D).transpose(0, 2, 1, 3)
    assert rel(q, rq.transpose(0, 2, 1, 3)) < 2e-2
    for h in range(H):   # per head: one bad block cannot hide in a whole-tensor norm
        assert rel(q[:, :, h], rq.transpose(0, 2, 1, 3)[:, :, h]) < 2e-2, h
    for h in range(HKV):
        assert rel(kc[:, h, off:off + L], rk[:, h]) < 2e-2, h
        assert rel(vc[:, h, off:off + L], rv[:, h]) < 2e-2, h
    # nothing else in the cache moved
    for c, c0 in ((kc, kc0), (vc, vc0)):
        assert mx.array_equal(c[:, :, :off], c0[:, :, :off]) and mx.array_equal(c[:, :, off + L:], c0[:, :, off + L:])


@pytest.mark.parametrize("dtype,D,G,B,length,S", [("bfloat16", 128, 4, 1, 255, 256), ("float16", 64, 7, 2, 1000, 1024)])
def test_decode_attention_tickets_lengths_and_views(dtype, D, G, B, length, S):
    """What the op table (tests/test_ops.py) does not cover: a second call (the split tickets must
    have been reset), the length as an array (the compiled step's), and a strided view of a larger
    buffer (the kernel indexes by strides; MLX must not copy)."""
    dt = getattr(mx, dtype)
    HKV = 2
    H = HKV * G
    q = mx.random.normal((B, H, 1, D)).astype(dt)
    big = mx.random.normal((2, B, HKV, S + 32, D)).astype(dt)
    kv, vv = big[0, :, :, 16:S + 16], big[1, :, :, 16:S + 16]
    scale = D ** -0.5
    ref = R.decode_attention(q.astype(mx.float32), kv.astype(mx.float32), vv.astype(mx.float32), length, scale)
    for n in (length, mx.array(length)):
        o = A.decode_attention(q, kv, vv, n, scale)
        assert o.shape == (B, H, 1, D)
        for b in range(B):
            for h in range(H):   # per head: one bad split cannot hide in a whole-tensor norm
                assert rel(o[b, h], ref[b, h]) < 1e-2, (b, h)


@pytest.mark.parametrize("L,G,gb,off,minch", [(2, 4, None, 200, None), (5, 4, None, 200, None), (1, 4, 2, 0, None),
                                              (1, 4, 2, 900, None), (3, 8, 2, 300, None), (1, 8, 4, 2000, None),
                                              (2, 4, 1, 40, None), (1, 4, 2, 1000, 128), (1, 8, 8, 700, 128),
                                              (1, 2, 1, 262, 128)])
def test_attention_multi_token_causal(L, G, gb, off, minch, monkeypatch, request):
    """L new tokens per row after `off` cached ones; gb < G: each block takes gb of the G query
    heads of its kv head (as in the one-launch layer), one split or many. minch: chunks of at least
    that many positions (ATTN_MINCH), so each online-softmax slot takes many rows and rescales its
    state as its max grows (the other cases give a slot 1-4 rows); off + 1 no multiple of the slots."""
    if minch:   # (ATTN_MINCH is not in the kernel cache's key: no kernel built under it outlives the test)
        monkeypatch.setattr(A, "ATTN_MINCH", minch)
        kernels.clear_builders()
        request.addfinalizer(kernels.clear_builders)
    dt, B, HKV, D = mx.bfloat16, 2, 2, 128
    S = off + L + 64
    q = mx.random.normal((B, L, HKV * G, D)).astype(dt)
    kc = mx.random.normal((B, HKV, S, D)).astype(dt)
    vc = mx.random.normal((B, HKV, S, D)).astype(dt)
    cnt = tickets(B * L * HKV * G)
    for _ in range(2):   # again: the tickets must have been left zero
        o = A.attention(q, kc, vc, offset_array(off), D ** -0.5, cnt, gb)
        k = kc[:, :, :off + L].astype(mx.float32)
        v = vc[:, :, :off + L].astype(mx.float32)
        ref = mx.fast.scaled_dot_product_attention(q.transpose(0, 2, 1, 3).astype(mx.float32), k, v,
                                                   scale=D ** -0.5, mask="causal").transpose(0, 2, 1, 3)
        for h in range(HKV * G):   # per head: a subgroup that is never computed cannot hide
            assert rel(o[:, :, h], ref[:, :, h]) < 1e-2, h


@pytest.mark.parametrize("name", ["qwen3-tiny", "llama-tiny", "qwen2-tiny"])
def test_fast_decode_path_tiny_model(name, monkeypatch):
    """The whole fused decode block (one launch per layer; the StaticKVCache written in place,
    tickets, the previous reader as an input) on tiny bf16 models, without mx.compile (the emulator runs
    outside MLX's graph), after a prompt that crosses 256. Teacher-forced along tokens stock picks
    (its argmax after each forced token), against the float32 evaluation of the same quantised
    model: the fused path must pick the oracle's token wherever the oracle's margin is clear, and be
    no further from it than stock."""
    from mlx_fastops import fidelity, synthetic_model
    import mlx_fastops

    monkeypatch.setenv("MLX_FASTOPS_BACKEND", "cuda")
    model = synthetic_model(name, bits=4, dtype=mx.bfloat16, seed=1)
    prompt = mx.random.randint(0, model.args.vocab_size, (300,), key=mx.random.key(4))
    first = fidelity.forced_logits(model, prompt, [0] * 12)
    tokens = [int(t) for t in mx.argmax(first, axis=-1).tolist()]
    oracle = fidelity.forced_logits(fidelity.fp32_oracle(synthetic_model(name, bits=4, dtype=mx.bfloat16, seed=1)),
                                    prompt, tokens)
    stock = fidelity.against(fidelity.forced_logits(model, prompt, tokens), oracle)
    report = mlx_fastops.patch(model, disable=("compile",))
    try:
        assert any(e.fusion == "fast_decode" and e.status == "fused" for e in report.entries), str(report)
        got = fidelity.forced_logits(model, prompt, tokens)
    finally:
        mlx_fastops.unpatch(model)
    fused = fidelity.against(got, oracle)
    print(f"{name} vs float32: stock {stock}, patched {fused}")
    assert np.isfinite(np.asarray(got)).all()
    assert fused["mean_abs"] <= 1.1 * stock["mean_abs"], (fused, stock)
    o = np.asarray(oracle)
    top2 = np.sort(o, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] >= 0.5
    assert clear.sum() >= 4, top2
    assert (np.asarray(got).argmax(-1)[clear] == o.argmax(-1)[clear]).all()
