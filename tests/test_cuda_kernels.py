"""The CUDA kernels' own paths, beyond the op table of tests/test_ops.py: bit-identity where two
code paths must agree (x staged or not, blocking rules, layers per launch), the QKV head epilogue,
the one-launch decoder layer and the decode step, on fresh random inputs.

On a machine with MLX's CUDA backend the kernels run on the GPU (`pytest -m cuda`). Everywhere else
the same tests run the same wrappers through the CPU emulator of tests/cuda_emu (CUDA-emulator-
verified: logic, indexing, barriers and shuffles; not timing or inter-block races).
"""

import contextlib
import json
import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_fastops import kernels
from mlx_fastops.backends.cuda import attention as A
from mlx_fastops.backends.cuda import block, layer, step
from mlx_fastops.backends.cuda import gemv as G
from mlx_fastops.backends.cuda.phases import STAMP_COLS, sm_load
from mlx_fastops.backends.cuda.source import offset_array, tickets
from mlx_fastops.backends import reference as R
from mlx_fastops.ops.weights import PackedLinear, RopeSpec

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("on_gpu")]   # on_gpu: the GPU, else the emulator

# Stock MLX ops are a second opinion, on the GPU only (within ~1-2% there); the float32 oracle is
# the first. MLX's CPU backend adds bf16 quantised matmuls up in bf16: 3-5% off at K >= 1024.
ON_GPU = mx.cuda.is_available()


def rel(a, b):
    a = np.asarray(a.astype(mx.float32)).astype(np.float64)
    b = np.asarray(b.astype(mx.float32)).astype(np.float64)
    assert np.isfinite(a).all(), "non-finite output"
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def packed(N, K, bits, gs, dtype, splits=None, bias=False):
    w = mx.random.normal((N, K)) * 0.05
    wq, s, b = mx.quantize(w, group_size=gs, bits=bits)
    return PackedLinear(wq, s.astype(dtype), b.astype(dtype),
                        (0.1 * mx.random.normal((N,))).astype(dtype) if bias else None,
                        tuple(splits or (N,)), K, bits, gs)


@contextlib.contextmanager
def unstaged():
    """Every gemv.cu GEMV converts x per warp at each k-step (without XK), as for rows too long
    to stage in shared memory (gemv_mma.cu's phases stay as they are)."""
    old = G.STAGE_MAX_FLOATS, G.STAGE_MAX_BYTES
    G.STAGE_MAX_FLOATS = G.STAGE_MAX_BYTES = 0
    kernels.clear_builders()
    try:
        yield
    finally:
        G.STAGE_MAX_FLOATS, G.STAGE_MAX_BYTES = old
        kernels.clear_builders()


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


@pytest.mark.parametrize("name,batch,L,mma,dtype", [
    ("qwen3-tiny", 1, 1, "", "bfloat16"), ("llama-tiny", 2, 1, "", "bfloat16"), ("qwen2-tiny", 1, 1, "", "bfloat16"),
    ("qwen3-tiny", 2, 3, "", "bfloat16"), ("llama-tiny", 1, 1, "all", "bfloat16"), ("qwen2-tiny", 2, 3, "all", "bfloat16"),
    ("llama-tiny", 2, 1, "all", "float16"), ("llama-tiny", 1, 1, "sliced", "bfloat16"),
    ("llama-tiny", 2, 2, "sliced_stream", "bfloat16"), ("llama-tiny-wide", 2, 1, "all", "float16"),
    ("llama-tiny-wide", 2, 4, "all", "bfloat16"), ("qwen2-tiny-g5", 1, 1, "", "bfloat16"),
    ("qwen2-tiny-g5", 2, 3, "", "bfloat16")])
def test_one_launch_layer_matches_stock_block(name, batch, L, mma, dtype, monkeypatch):
    """One layer's launch (fb.core) against the decoder block it replaces, evaluated in float32
    (dequantised weights, float32 activations) on the same inputs over a KVCache holding the same
    P cached rows: the block's output and the k/v rows written in place into the cache buffers
    (nothing else there moves), no further from float32 than the stock bf16 block (which adds up
    in bf16). Again with x unstaged (the path of rows too long for shared memory): bit for bit the
    default launch's; and with attention blocks of another number of query heads (all G, or 1 where
    the default takes all): the cache bit for bit, the attention output at most one rounding step off
    in at most 1% of its values, the block's output near (the split count and the merge's parts
    follow the heads per block, so the sums run in another order: in half precision a rounding now
    and then lands on the other side). mma "all": every phase that gemv_mma.cu can take runs on it;
    "sliced": so too, with shared memory for one chunk of x at a time (o_proj: K in 2 slices);
    "sliced_stream": and an 8-block wave (o_proj's 16 tiles 2 to a block). In float16 too (gemv_mma.cu's
    E = 1024 and f16 mma). llama-tiny-wide (K 2304): QKV's and gate/up's staging takes two items a
    thread, the first step before the norm at 2 rows, and at 8 rows its later steps."""
    from mlx_lm.models.cache import KVCache
    from mlx_fastops import fidelity, synthetic_model
    import mlx_fastops

    monkeypatch.setenv("MLX_FASTOPS_BACKEND", "cuda")
    dt = getattr(mx, dtype)
    if mma:   # every phase gemv_mma.cu takes (its K a multiple of 256) on tensor cores, whatever its rows
        monkeypatch.setattr(G, "MMA_MIN_ROWS", 1)
        monkeypatch.setattr(block, "GROUP_MAX_WEIGHTS", 0)   # QKV as in a large layer
        if mma != "all":   # shared memory for one chunk of x beside a set of partials per tile
            tpb = 2 if mma == "sliced_stream" else 1
            monkeypatch.setattr(G, "RESIDENT_BLOCKS", 16 // tpb)
            one_chunk = 4 * G._MMA_GROUP_ROW_BYTES * batch * L
            monkeypatch.setattr(G, "MMA_STAGE_MAX_BYTES", tpb * G._MMA_PARTIALS + one_chunk)
        kernels.clear_builders()
    model = synthetic_model(name, bits=4, dtype=dt, seed=2)
    stock = model.model.layers[0]
    mlx_fastops.patch(model, disable=("compile",))
    try:
        fb = model.model.layers[0].fast_fn
        P, D, S = 270, fb.D, 512
        k0 = mx.random.normal((batch, fb.HKV, S, D)).astype(dt)
        v0 = mx.random.normal((batch, fb.HKV, S, D)).astype(dt)
        x = mx.random.normal((batch, L, model.args.hidden_size)).astype(dt)   # L new tokens each

        def run():
            kc, vc = k0 + 0, v0 + 0
            mx.eval(kc, vc)
            out, o = fb.core(x, offset_array(P), kc, vc, kc)
            mx.eval(out, o)
            return out, kc, vc, o

        launched = run()
        variants = []
        if mma:   # gate/up (sliced: o_proj) ran on tensor cores (the variants below would turn it off: other bits)
            M, gu, o = batch * L, fb.gate_up, fb.o
            if mma == "all":
                assert G.mma_takes(dt, M, gu.in_features, gu.out_features, 4, 64, 2, False, True)
                qkv = fb.qkv   # with its head epilogue, and its bias (qwen2-tiny)
                assert G.mma_takes(dt, M, qkv.in_features, qkv.out_features, 4, 64, 3,
                                   qkv.bias is not None, True, fb.D, not fb.grouped)
            else:
                assert G.mma_takes(dt, M, o.in_features, o.out_features, 4, 64, 1, False, True)
                assert G.mma_plan(M, o.in_features, o.out_features, 1) == (4, tpb, 16 // tpb)
        else:
            with unstaged():
                variants = [run()]
            G_ = fb.H // fb.HKV
            fb.gb, gb = (G_ if G_ != fb.gb else 1), fb.gb   # attention blocks of another head count
            other_heads = run()
            fb.gb = gb
        for name_, c in (("group", fb.layer_counters(1)), ("head", fb.head_tickets), ("attention", fb.attn_tickets)):
            assert not np.asarray(c).any(), f"{name_} tickets not reset"
    finally:
        mlx_fastops.unpatch(model)
        kernels.clear_builders()   # no kernel built with the forced tiles outlives the test
    oracle = fidelity.fp32_oracle(synthetic_model(name, bits=4, dtype=dt, seed=2)).model.layers[0]
    f32 = lambda a: a.astype(mx.float32)
    mask = "causal" if L > 1 else None
    ref, ref_cache = [], []
    for blk, cast in ((oracle, f32), (stock, lambda a: a)):
        cache = KVCache()
        cache.update_and_fetch(cast(k0[:, :, :P]), cast(v0[:, :, :P]))
        ref.append(blk(cast(x), mask=mask, cache=cache))
        ref_cache.append(cache)
    out, kc, vc, o = launched
    assert rel(out, ref[0]) <= max(1.1 * rel(ref[1], ref[0]), 1e-2)
    for ours, old, new, stock_new in ((kc, k0, ref_cache[0].keys, ref_cache[1].keys),
                                      (vc, v0, ref_cache[0].values, ref_cache[1].values)):
        rows = lambda a: a[:, :, P:P + L]
        assert rel(rows(ours), rows(new)) <= max(1.1 * rel(rows(stock_new), rows(new)), 1e-2)
        assert mx.array_equal(ours[:, :, :P], old[:, :, :P]) and mx.array_equal(ours[:, :, P + L:], old[:, :, P + L:])
    for variant in variants:
        for a, b in zip(launched, variant):
            assert mx.array_equal(a, b)
    if not mma:   # the attention output at most a rounding step off, in a few places; what follows it near
        assert mx.array_equal(other_heads[1], kc) and mx.array_equal(other_heads[2], vc)
        a, b = (np.asarray(t.astype(mx.float32)).astype(np.float64) for t in (other_heads[3], o))
        _, e = np.frexp(np.maximum(np.abs(a), np.abs(b)))
        steps = np.abs(a - b) / np.ldexp(1.0, e - (8 if dt == mx.bfloat16 else 11))   # ulps of dt
        assert steps.max() <= 1 and (steps > 0).mean() <= 0.01, (steps.max(), (steps > 0).mean())
        assert rel(other_heads[0], out) <= 1e-3


def layer_outputs(fb, x, k0):
    """One layer launch (fb.core) over x at offset 300 of a fresh cache (k0, and 2 k0 as v): its
    outputs, then the cache buffers it wrote into."""
    kc, vc = k0 + 0, k0 * 2
    mx.eval(kc, vc)
    out = fb.core(x, offset_array(300), kc, vc, kc) + (kc, vc)
    mx.eval(out)
    return out


@pytest.mark.parametrize("batch", [2, 8])
def test_qkv_bias_on_tensor_cores_rounds_as_gemv(batch, monkeypatch):
    """Qwen2.5's QKV bias on gemv_mma.cu's head epilogue rounds as gemv.cu's does: T(T(acc) + bias).
    With x = +-1, the input norm's weight 1 and QKV weights (q - 8) / 8, every product and sum of
    either GEMV is exact in fp32, so both reach the same acc whatever their order; the sums need
    more bits than T holds, and the bias as much as they do, so both roundings are exercised. The
    launch with QKV on tensor cores must then equal, bit for bit, the one with QKV on gemv.cu (the
    other phases the same in both)."""
    from mlx_fastops import synthetic_model
    import mlx_fastops

    monkeypatch.setenv("MLX_FASTOPS_BACKEND", "cuda")
    monkeypatch.setattr(G, "MMA_MIN_ROWS", 1)
    monkeypatch.setattr(block, "GROUP_MAX_WEIGHTS", 0)   # QKV as in a large layer
    kernels.clear_builders()
    model = synthetic_model("qwen2-tiny", bits=4, dtype=mx.bfloat16, seed=5)
    blk = model.model.layers[0]
    blk.input_layernorm.weight = mx.ones_like(blk.input_layernorm.weight)
    for proj in (blk.self_attn.q_proj, blk.self_attn.k_proj, blk.self_attn.v_proj):
        proj.scales = mx.full(proj.scales.shape, 0.125, proj.scales.dtype)
        proj.biases = mx.full(proj.biases.shape, -1.0, proj.biases.dtype)
        # as large as the sums, so that T(acc)'s rounding shows through their cancellations
        proj.bias = (8 * mx.random.normal(proj.bias.shape)).astype(proj.bias.dtype)
    mlx_fastops.patch(model, disable=("compile",))
    try:
        fb = model.model.layers[0].fast_fn
        qkv = fb.qkv
        assert qkv.bias is not None and G.mma_takes(mx.bfloat16, batch, qkv.in_features, qkv.out_features, 4, 64,
                                                     3, True, True, fb.D, not fb.grouped)
        x = (2 * mx.random.bernoulli(shape=(batch, 1, qkv.in_features)) - 1).astype(mx.bfloat16)
        k0 = mx.random.normal((batch, fb.HKV, 512, fb.D)).astype(mx.bfloat16)
        on_mma = layer_outputs(fb, x, k0)
        monkeypatch.setattr(layer, "mma_takes", lambda *a, **k: a[6] != 3 and G.mma_takes(*a, **k))
        kernels.clear_builders()
        on_gemv = layer_outputs(fb, x, k0)
    finally:
        mlx_fastops.unpatch(model)
        kernels.clear_builders()
    for a, b in zip(on_mma, on_gemv):
        assert mx.array_equal(a, b)


# Real layer shapes ((bits, gs, N, K) of qkv, o, gate/up, down), heads (H, HKV, D), then the blocks
# of the GEMV phases of one launch at batch 1 (qkv, o, gate/up, down) and whether x is staged.
LAYERS = [
    ("qwen3-0.6b", ((4, 64, 4096, 1024), (4, 64, 1024, 2048), (4, 64, 6144, 1024), (4, 64, 1024, 3072)),
     (16, 8, 128), (512, 256, 384, 256), True),
    ("qwen3-4b", ((4, 64, 6144, 2560), (4, 64, 2560, 4096), (4, 64, 19456, 2560), (4, 64, 2560, 9728)),
     (32, 8, 128), (384, 320, 406, 320), True),
    ("qwen3-8b", ((4, 64, 6144, 4096), (4, 64, 4096, 4096), (4, 64, 24576, 4096), (4, 64, 4096, 12288)),
     (32, 8, 128), (384, 512, 512, 512), True),
    ("llama-3.2-1b", ((4, 64, 3072, 2048), (4, 64, 2048, 2048), (4, 64, 16384, 2048), (4, 64, 2048, 8192)),
     (32, 8, 64), (384, 512, 512, 512), True),
    ("qwen2.5-0.5b", ((4, 64, 1152, 896), (4, 64, 896, 896), (4, 64, 9728, 896), (4, 64, 896, 4864)),
     (14, 2, 64), (144, 224, 304, 224), True),
    ("G 2, D 256", ((4, 64, 4096, 1024), (4, 64, 1024, 2048), (4, 64, 6144, 1024), (4, 64, 1024, 3072)),
     (8, 4, 256), (512, 256, 384, 256), False),   # attention blocks of 512 query-head values
]


@pytest.mark.parametrize("M,configs", [
    (1, ((4, 4), (4, 2), (4, 2), (4, 2))), (2, ((4, 4), (4, 2), (4, 2), (4, 2))),
    (4, ((2, 2), (2, 2), (2, 1), (2, 2))), (8, ((1, 4), (1, 2), (1, 2), (1, 2)))])
def test_layer_gemv_blocking_by_rows(M, configs):
    """(VEC, R) of Qwen3-4B's QKV, o_proj, gate/up and down phases by activation rows: 16-byte lane
    loads (VEC 4) up to 2 rows, then 8 and 4 bytes; beside 8-byte loads of 3-4 rows at most 8
    accumulators (weight rows x rows) per lane, so the launch stays within 128 registers (4 blocks
    per SM; tests/cuda_compile_check.py); from 5 rows on the rows per warp of one row."""
    shapes = LAYERS[1][1]
    got = tuple(G.gemv_config(M, K, N, bits, epi, one_wave=True)[:2]
                for (bits, _, N, K), epi in zip(shapes, (3, 1, 2, 1)))
    assert got == configs


def captured_layer(M, shapes, heads, nsplit, large=False):
    """layer.layer_build's kernel arguments and blocks per phase for a bf16 layer of these shapes and
    (H, HKV, D) heads (Qwen3-style: q/k norms) at M rows over nsplit attention splits, captured:
    nothing is built."""
    H, HKV, D = heads
    head = dict(D=D, H=H, HKV=HKV, L=1, freqs=False, qknorm=True, trad=False, qeps=1e-6, keps=1e-6,
                log2_base=20.0, scale=1.0)
    with kernels.use_cuda_factory(lambda **kw: kw):
        kw, groups, _ = layer.layer_build(mx.bfloat16, M, shapes, 1e-6, 1e-6, False, tuple(sorted(head.items())),
                                          nsplit, 0.088, A.head_subgroup(H // HKV), 1, False, large)
    return kw, groups


@pytest.mark.parametrize("name,M,on_mma", [
    ("qwen3-0.6b", 1, (False, False, True, False)), ("qwen3-0.6b", 2, (False, True, True, True)),
    ("qwen3-4b", 1, (True, True, True, True)), ("qwen3-4b", 2, (True, True, True, True)),
    ("qwen3-8b", 1, (True, True, True, True)), ("qwen3-8b", 4, (True, True, True, True)),
    ("llama-3.2-1b", 1, (False, False, True, False)), ("llama-3.2-1b", 2, (False, True, True, True)),
    ("qwen2.5-0.5b", 4, (False, False, False, True)), ("G 2, D 256", 2, (False, False, False, False))])
def test_layer_phases_on_tensor_cores(name, M, on_mma):
    """Which phases (QKV, o_proj, gate/up, down) gemv_mma.cu takes, as measured (gemv.py): gate/up
    always; o_proj and down from 2 rows, at one row where their tiles fill more than half the wave
    (Qwen3-4B / 8B, not Llama-3.2-1B's 256 or Qwen3-0.6B's 128); QKV so too (Qwen3-4B / 8B: 384
    tiles) in layers of over GROUP_MAX_WEIGHTS where a head is whole tiles of 16 rows; only K a multiple of
    256 and where the attention blocks leave room for staged x (Qwen2.5-0.5B: K 896 but its down's
    4864, with room since its 7 query heads take a block each: attention.head_subgroup)."""
    shapes, (H, HKV, D) = {n: (s, h) for n, s, h, *_ in LAYERS}[name]
    large = sum(N * K for _, _, N, K in shapes) > block.GROUP_MAX_WEIGHTS
    room = A.head_subgroup(H // HKV) * D <= 256   # as layer_build
    got = tuple(G.mma_takes(mx.bfloat16, M, K, N, bits, gs, epi, False, room, D, large)
                for (bits, gs, N, K), epi in zip(shapes, (3, 1, 2, 1)))
    assert got == on_mma
    qkv = shapes[0]
    # a QKV bias (Qwen2.5) rides gemv_mma.cu's head epilogue; no other phase there takes one
    assert G.mma_takes(mx.bfloat16, M, qkv[3], qkv[2], 4, 64, 3, True, room, D, large) == on_mma[0]
    assert not any(G.mma_takes(mx.bfloat16, M, K, N, bits, gs, epi, True, room)
                   for (bits, gs, N, K), epi in zip(shapes[1:], (1, 2, 1)))
    with pytest.raises(ValueError, match="only in the QKV phase"):
        G.mma_defines(mx.bfloat16, M, shapes[1][2], 1, None, (1, 1, 1), bias=True)
    if M == 1 and not large:   # a small model's layers launched one by one (GROUP_MAX_WEIGHTS 0) round as
        # its grouped launch does: QKV's tiles do not fill the wave (test_cuda_models' bitwise test)
        assert not G.mma_takes(mx.bfloat16, 1, qkv[3], qkv[2], 4, 64, 3, False, room, D, True)
    # heads of 72: not whole tiles
    assert not G.mma_takes(mx.bfloat16, 4, qkv[3], qkv[2], 4, 64, 3, False, True, 72, True)
    # the layer built: each phase's source is gemv_mma.cu (mma.sync) exactly where the rule says
    kw, _ = captured_layer(M, shapes, (H, HKV, D), 3, large)
    phases = {p.split("(")[0]: p for p in kw["header"].split("__device__ void layer_")[1:]}
    assert tuple("mma.sync" in phases[p] for p in ("qkv", "o", "gate_up", "down")) == on_mma
    # no GEMV phase of a large layer sends rows to L2 before its wait (design doc)
    early = tuple("#define NO_EARLY_PREFETCH" not in phases[p] for p in ("qkv", "o", "gate_up", "down"))
    assert early == (not large,) * 4
    assert not G.mma_takes(mx.bfloat16, M, *shapes[1][3:1:-1], 8, 64, 1, False, True)   # 8-bit: gemv.cu
    assert not G.mma_takes(mx.bfloat16, M, *shapes[2][3:1:-1], 4, 32, 2, False, True)   # groups of 32


@pytest.mark.parametrize("name,shapes,heads,blocks,staged", LAYERS)
def test_layer_launch_sizes(name, shapes, heads, blocks, staged):
    """How the one-launch layer is cut on the H200 at one row (as measured: docs/cuda-design.md):
    the phases on tensor cores (gemv_mma.cu) a block per tile (o_proj/down 8 rows, gate/up 8 + 8
    streamed to fit one wave of 528 blocks); on gemv.cu Qwen3-4B/8B's QKV takes more rows per warp
    to fit the wave, the rest one row group per block as a GEMV launched alone would (Qwen2.5-0.5B's
    gate/up several per block); x is staged in shared memory except beside attention blocks of more than
    256 query-head values (at 4 rows the launch would exceed 48 KB of shared memory; Qwen2.5's GQA 7
    takes blocks of one head: attention.head_subgroup)."""
    kw, groups = captured_layer(1, shapes, heads, 17)
    epis = (3, 1, 2, 1)
    alone = [G.gemv_blocks(N, e, G.gemv_config(1, K, N, b, e)[1], 4) for (b, _, N, K), e in zip(shapes, epis)]
    assert (groups[0], *groups[2:]) == blocks
    assert max(groups[i] for i in (0, 2, 3, 4)) <= G.RESIDENT_BLOCKS
    assert all(a >= b for a, b in zip(alone, (groups[0], *groups[2:5])))   # the rules only ever remove blocks
    assert (kw["shared_memory"] > 0) == staged


def test_attention_head_subgroups():
    """Query heads per attention block of the one-launch layer: pairs of an even G, one of an odd G
    (all of an odd G took the launch over 128 registers: attention.head_subgroup)."""
    assert [A.head_subgroup(G) for G in range(1, 9)] == [1, 2, 1, 2, 1, 2, 1, 2]


@pytest.mark.parametrize("name,heads,one_row", [(name, heads, n) for (name, _, heads, _, _), n in
                                                zip(LAYERS, (64, 33, 33, 33, 37, 64))])
def test_attention_splits_within_one_wave(name, heads, one_row):
    """Decode attention's splits of the sequence (attention.attn_partials, as layer.layers_launch and
    FastBlock.wide ask for them) at 1-64 rows: at most ATTN_TARGET_BLOCKS blocks (more were slower on
    the H200: docs/cuda-design.md) and the merge's 64 splits, partials sized by them; at one row the
    measured cut (Qwen3-4B/8B: 33 splits of 16 kv head x head subgroup rows, every one of 528 slots)."""
    H, HKV, D = heads
    G = H // HKV
    gb = A.head_subgroup(G)
    for M in range(1, 65):
        nsplit, (pm, po) = A.attn_partials(M * HKV, None, G, gb, D)
        blocks = nsplit * M * HKV * (G // gb)
        assert 1 <= nsplit <= A.ATTN_MAX_SPLITS and (blocks <= A.ATTN_TARGET_BLOCKS or nsplit == 1), (M, nsplit)
        assert pm == (M * HKV, nsplit, G, 2) and po == (M * HKV, nsplit, G, D)
        if M == 1:
            assert nsplit == one_row


@pytest.mark.parametrize("variant,name,batch,L", [
    ("one_wave", "qwen3-tiny", 1, 1), ("one_wave", "llama-tiny", 2, 1), ("stream", "qwen3-tiny", 1, 1),
    ("stream", "qwen3-tiny", 2, 1), ("stream_mma", "llama-tiny", 1, 1), ("stream_mma", "llama-tiny", 2, 3)])
def test_layer_blocking_keeps_bits(variant, name, batch, L, monkeypatch):
    """The launch's blocking rules, forced onto a tiny model by a smaller wave, keep the layer's
    outputs and cache rows bit for bit. one_wave (a one-block wave, any K): every GEMV phase takes
    its most rows per warp (QKV 4, so its blocks tile a head in 4 instead of 16). stream (a
    three-block wave): the o_proj, gate/up and down phases run their row groups 3 blocks at a time,
    in uneven shares, against one group per block (gemv.cu: Qwen3-tiny's K = 192 is not gemv_mma.cu's).
    stream_mma: the same over gemv_mma.cu's tiles (gate/up's 56 tiles 3 blocks at a time)."""
    from mlx_fastops import synthetic_model
    import mlx_fastops

    monkeypatch.setenv("MLX_FASTOPS_BACKEND", "cuda")
    model = synthetic_model(name, bits=4, dtype=mx.bfloat16, seed=3)
    mlx_fastops.patch(model, disable=("compile",))
    try:
        fb = model.model.layers[0].fast_fn
        M, K = batch * L, fb.K
        k0 = mx.random.normal((batch, fb.HKV, 512, fb.D)).astype(mx.bfloat16)
        x = mx.random.normal((batch, L, model.args.hidden_size)).astype(mx.bfloat16)
        base = layer_outputs(fb, x, k0)
        if variant == "one_wave":
            assert G.gemv_config(M, K, fb.qkv.out_features, 4, 3, True)[1] == 2
            monkeypatch.setattr(G, "RESIDENT_BLOCKS", 1)
            monkeypatch.setattr(G, "ONE_WAVE_MIN_K", 0)
            kernels.clear_builders()
            assert G.gemv_config(M, K, fb.qkv.out_features, 4, 3, True)[1] == 4
        else:
            monkeypatch.setattr(G, "RESIDENT_BLOCKS", 3)
            kernels.clear_builders()
            N = fb.gate_up.out_features
            assert G.mma_takes(mx.bfloat16, M, K, N, 4, 64, 2, False, True) == (variant == "stream_mma")
            if variant == "stream_mma":
                nb = G.mma_tiles(N, 2)
            else:
                nb = G.gemv_blocks(N, 2, G.gemv_config(M, K, N, 4, 2, True)[1], 4)
            assert G.stream_blocks(nb) == 3 and nb % 3   # streamed, in uneven shares
        forced = layer_outputs(fb, x, k0)
    finally:
        mlx_fastops.unpatch(model)
        kernels.clear_builders()   # no kernel built with the forced sizes outlives the test
    for a, b in zip(base, forced):
        assert mx.array_equal(a, b)


@pytest.mark.parametrize("name,batch,L,layers", [("qwen3-tiny", 1, 1, 3), ("llama-tiny", 2, 2, 2),
                                                 ("qwen2-tiny", 1, 1, 3), ("qwen3-tiny", 2, 1, 3)])
def test_layers_in_one_launch_match_one_per_layer(name, batch, L, layers, monkeypatch):
    """Every layer of a short model in one launch (the residual stream between them in scratch
    outputs, one call site per phase) computes exactly what one launch
    per layer computes; so does the launch with phase stamps (layers_launch(stamps=True), which
    benchmarks/cuda_layer_phases.py reads), whose every block is stamped, entry before end, and
    ends after every block of the group before it (its wait; attention blocks whose split is past
    the valid length exit at once), across the layers; every block that waits marks its wait's end
    after the group before it ended, then its first step and its written outputs, in that order
    before its end (one that exits early marks nothing); the benchmark's per-phase tables of them
    are ordered the same way."""
    from mlx_fastops import synthetic_model
    import mlx_fastops

    monkeypatch.setenv("MLX_FASTOPS_BACKEND", "cuda")
    model = synthetic_model(name, bits=4, dtype=mx.bfloat16, seed=3, layers=layers)
    mlx_fastops.patch(model, disable=("compile",))
    try:
        fbs = [layer.fast_fn for layer in model.model.layers]
        assert len(fbs) == layers and all(fb.launch_key() == fbs[0].launch_key() for fb in fbs)
        P, D, HKV = 300, fbs[0].D, fbs[0].HKV
        caches = [[mx.random.normal((batch, HKV, 512, D)).astype(mx.bfloat16) for _ in range(2)] for _ in fbs]
        x = mx.random.normal((batch, L, model.args.hidden_size)).astype(mx.bfloat16)
        off = offset_array(P)
        results = []
        for mode in ("per layer", "together", "stamped"):
            bufs = [(kc + 0, vc + 0) for kc, vc in caches]
            mx.eval(bufs)
            if mode == "per layer":
                out = x
                for fb, (kc, vc) in zip(fbs, bufs):
                    out, o = fb.core(out, off, kc, vc, kc)
            else:
                out, o, *stamped = layer.layers_launch(fbs, x, off, [(kc, vc, kc) for kc, vc in bufs],
                                                   stamps=mode == "stamped")
            mx.eval(out, o)
            results.append((out, o, bufs))
        assert not np.asarray(fbs[0].layer_counters(layers)).any(), "counters not reset"
    finally:
        mlx_fastops.unpatch(model)
    (out1, o1, bufs1), *launched = results
    assert np.isfinite(np.asarray(out1.astype(mx.float32))).all()
    for out2, o2, bufs2 in launched:
        assert mx.array_equal(out1, out2) and mx.array_equal(o1, o2)   # o: the last layer's attention
        for (k1, v1), (k2, v2) in zip(bufs1, bufs2):
            assert mx.array_equal(k1, k2) and mx.array_equal(v1, v2)
    st, groups = np.asarray(stamped[0]), stamped[1]
    assert len(groups) == layers * layer.LAYER_GROUPS and st.shape == (sum(groups), STAMP_COLS)
    assert (st != 0x7F7F7F7F7F7F7F7F).all() and (st[:, 0] < st[:, 1]).all(), "a block was not stamped"
    assert ((st[:, 2] >= 0) & (st[:, 2] < 1024)).all(), "an SM id out of range"
    bounds = np.cumsum([0, *groups])
    ends = [st[a:b, 1] for a, b in zip(bounds[:-1], bounds[1:])]
    fb = fbs[0]
    # the attention groups hold the launch's splits for every (row, kv head, head subgroup)
    group = fb.H // fb.HKV
    splits = layer.attention_splits(fb, batch * L)[0]
    assert all(n == splits * fb.HKV * (group // fb.gb) * batch * L for n in groups[1::layer.LAYER_GROUPS])
    for g in range(1, len(ends)):
        waited = np.ones(len(ends[g]), bool)
        if g % layer.LAYER_GROUPS == 1:   # attention: a split past the valid length exits before its wait
            i = np.arange(len(waited))
            n = P + (i // (len(waited) // (batch * L))) % L + 1   # positions of block i's query
            chunk = np.maximum(-(-n // splits), A.ATTN_MINCH)
            waited = i % splits < -(-n // chunk)
        assert ends[g][waited].min() > ends[g - 1].max(), f"group {g} ended before group {g - 1}"
        marks = st[bounds[g]:bounds[g + 1], 3:]
        assert (marks[waited] != 0).all() and (marks[~waited] == 0).all(), f"group {g}: marks of the wrong blocks"
        assert marks[waited, 0].min() > ends[g - 1].max(), f"group {g}: a wait's mark before group {g - 1} ended"
    assert (st[:groups[0], 3:] != 0).all(), "a block of the first group did not mark"
    assert_marks_in_order(st)
    from mlx_fastops.backends.cuda.phases import mark_rows, phase_rows, set_tails
    rows = phase_rows(st, groups)
    # blocks of several groups enter within one tick of the first: the earliest is any group's
    assert len(rows) == len(groups) and min(r[0] for r in rows) == 0.0
    for (first, ready, p90, end), prev in zip(rows, [(0, 0, 0, 0.0)] + rows):
        assert ready == prev[3] and first <= p90 <= end and end > ready
    for (_, ready, _, end), med, high in zip(rows, mark_rows(st, groups), mark_rows(st, groups, 90)):
        assert list(med) == sorted(med) and all(a <= b for a, b in zip(med, high))
        assert ready <= med[0] and high[-1] <= end
    # the benchmark's ticketed sets (a row's splits; a head's QKV blocks): a tail each, none elsewhere
    tails = set_tails(st, groups, layer.ticketed_sets(fb, groups, batch * L))
    assert [t is not None for t in tails] == [g % layer.LAYER_GROUPS < 2 for g in range(len(groups))]


@pytest.mark.parametrize("late_entry,late,per_sm", [(16, [0, 1], 2), (11, [0, 0], 3)])
def test_phase_stamps_second_wave_and_residency(late_entry, late, per_sm):
    """phases.late_blocks counts a group's blocks that entered after one of its own had ended;
    residency gives the most blocks alive at once (in the launch, on one SM) and the SMs."""
    from mlx_fastops.backends.cuda.phases import late_blocks, residency
    st = np.array([(0, 10, 0), (0, 12, 1),                         # group 0
                   (1, 20, 0), (1, 15, 1), (late_entry, 25, 1)])   # group 1: its block 1 ends at 15
    assert late_blocks(st, [2, 3]) == late
    assert residency(st) == (4, per_sm, 2)


def assert_marks_in_order(st):
    """Every block that marked (an attention split past the valid length exits before its wait) took
    its entry, marks and end in this order: strictly on the emulator (a tick per reading), on the GPU
    within %globaltimer's steps (32 ns: a TILE8 phase's wait and first step can share one)."""
    marked = st[(st[:, 3:] != 0).all(axis=1)]
    steps = np.diff(marked[:, [0, *range(3, STAMP_COLS), 1]], axis=1)
    assert len(marked) and ((steps >= 0) if ON_GPU else (steps > 0)).all(), "marks out of order"


def test_phase_tables_over_a_float_and_a_quantized_cache(monkeypatch):
    """benchmarks/cuda_layer_phases.py (measure, markdown) on a tiny model over the float cache and an
    8-bit one (--kv-bits): a table of each, every phase's median marks in order from its ready time to
    its end, the quantised cache's attention reading fewer bytes, its table and summary row labelled."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "cuda_layer_phases.py"
    spec = importlib.util.spec_from_file_location("cuda_layer_phases", path)
    lp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lp)
    monkeypatch.setenv("MLX_FASTOPS_BACKEND", "cuda")   # (measure sets it: restored after the test)
    runs = [r for kv in (0, 8) for r in lp.measure("qwen3-tiny-qmm", [1], 100, 1, [A.ATTN_TARGET_BLOCKS], ["compile"],
                                                    flush_mb=0, kv_bits=kv, keep_stamps=kv == 0)]
    assert "stamps_median_rep" in runs[0] and "stamps_median_rep" not in runs[1]   # only where asked
    assert [r["kv_bits"] for r in runs] == [0, 8]
    for r in runs:
        assert [p["phase"] for p in r["phases"]] == list(lp.PHASES)
        for p in r["phases"]:
            marks = p["marks_median_us"]
            assert p["ready_us"] <= marks[0] and list(marks) == sorted(marks) and marks[-1] <= p["end_us"], p
        for p in r["phases"]:   # no more SMs than the launch ran on (the emulator runs every block on "SM 0")
            assert sum(v[0] for v in p["per_sm"].values()) <= r["sms"], p
            assert ON_GPU or list(p["per_sm"]) == [str(p["blocks"])], p
        if "stamps_median_rep" not in r:
            continue
        st = np.array(json.loads(json.dumps(r["stamps_median_rep"])))   # the JSON's raw stamps: every block
        assert st.shape == (sum(r["groups"]), STAMP_COLS) and st[:, 0].min() == 0 and (st[:, 1] > st[:, 0]).all()
        for p, load in zip(r["phases"], sm_load(st, r["groups"])):   # the per-SM table reads those stamps
            assert p["per_sm"] == {str(k): v for k, v in load.items()}, p
    from types import SimpleNamespace
    w = SimpleNamespace(weight=np.zeros(1), scales=np.zeros(1), biases=np.zeros(1))
    fb = SimpleNamespace(HKV=2, D=64, qkv=w, o=w, gate_up=w, down=w)   # qwen3-tiny-qmm's heads
    float_attn, kv8_attn = (lp.phase_bytes(fb, 1, 101, kv)[1] for kv in (0, 8))   # K and V of 101 positions
    assert float_attn == 2 * 2 * 101 * 128 and kv8_attn == 2 * 2 * 101 * (64 + 4)   # + a bf16 scale and bias
    got = [r["phases"][1]["GBs"] * r["phases"][1]["time_us"] * 1e3 for r in runs]   # the tables' bytes
    assert got == pytest.approx([float_attn, kv8_attn])
    md = lp.markdown(runs, {"device": "-", "mlx": "-", "commit": "-", "source": "-", "copy_GBs": 1.0})
    assert md.count("Inside the phases") == 2 and md.count("Blocks of a phase per SM") == 2
    assert "cached positions, kv_bits 8," in md and "| qwen3-tiny-qmm (kv_bits 8) |" in md


def test_relative_stamps_keep_unreached_marks():
    """phases.relative_stamps: times from the first entry, a mark of 0 (not reached) still 0, SMs kept."""
    from mlx_fastops.backends.cuda.phases import relative_stamps
    st = [(5000, 9000, 7, 6000, 7000, 8000), (4000, 4500, 3, 0, 0, 0)]   # the second block exited early
    assert relative_stamps(st) == [[1000, 5000, 7, 2000, 3000, 4000], [0, 500, 3, 0, 0, 0]]


def test_sm_load_groups_blocks_by_their_sms_count():
    """phases.sm_load: per group, SMs by how many of its blocks they ran, and those blocks' median end."""
    from mlx_fastops.backends.cuda.phases import sm_load
    st = [(0, 1000, 0), (0, 2000, 0), (0, 3000, 0), (0, 500, 1),   # group 0: SM 0 ran 3, SM 1 ran 1
          (0, 4000, 0), (0, 6000, 1)]                              # group 1: one each
    assert sm_load(st, [4, 2]) == [{1: (1, 0.5), 3: (1, 2.0)}, {1: (2, 5.0)}]


@pytest.mark.parametrize("sets,tails", [([2, 3], [(0.85, 1.5), (0.5, 0.5)]),   # group 0's sets end 1.2, 1.0 / 3.0, 1.5
                                        ([4, 0], [(1.5, 1.5), None]),
                                        ([3, 3], ValueError)])                  # 4 blocks are no sets of 3
def test_phase_set_tails(sets, tails):
    """phases.set_tails: per ticketed set of consecutive blocks, its last end minus its second-last
    (whatever their order in the set); the median over the group's sets and the value of the set
    that ended last; sets that do not tile a group are refused."""
    from mlx_fastops.backends.cuda.phases import set_tails
    st = np.array([(0, 1200, 0), (0, 1000, 0), (0, 3000, 0), (0, 1500, 0),   # group 0
                   (0, 3800, 0), (0, 3100, 0), (0, 3300, 0)])                # group 1
    if tails is ValueError:
        with pytest.raises(ValueError, match="do not tile"):
            set_tails(st, [4, 3], sets)
        return
    got = set_tails(st, [4, 3], sets)
    assert [g if g is None else tuple(round(v, 9) for v in g) for g in got] == tails


def test_decode_step_with_layers_sharing_launches(monkeypatch):
    """The decode step (run eagerly: the emulator cannot be traced by mx.compile) with both layers
    in one launch (the default for small layers) gives the same logits as with one launch per layer
    (layers above GROUP_MAX_WEIGHTS) and as large layers sharing a launch at one row
    (LARGE_SHARED_MAX_ROWS); the step launches what launch_runs says for its row count (a 6-token
    prompt, then one-row steps), and the report's compile row says so."""
    from mlx_fastops import fidelity, synthetic_model
    import mlx_fastops

    monkeypatch.setenv("MLX_FASTOPS_BACKEND", "cuda")
    launched = set()   # (rows of the step, layers in the launch)

    def launch(blocks, x, *args, _launch=step.layers_launch):
        launched.add((x.shape[0] * x.shape[1], len(blocks)))
        return _launch(blocks, x, *args)

    monkeypatch.setattr(step, "layers_launch", launch)
    prompt = mx.random.randint(0, 4096, (6,), key=mx.random.key(5))
    logits = []
    mx.disable_compile()
    try:
        wide = "; decode steps of over 8 rows: the composed ops (a weight qmm does not take)"   # hidden size 192
        for limit, shared_rows, launches, note in (
                (block.GROUP_MAX_WEIGHTS, 0, {(6, 2), (1, 2)}, "2 layers in 1 launch" + wide),
                (0, 0, {(6, 1), (1, 1)}, "2 layers in 2 launches" + wide),
                (0, 1, {(6, 1), (1, 2)}, "2 layers in 1 launch at 1 row, 2 launches at 2-8 rows" + wide)):
            monkeypatch.setattr(block, "GROUP_MAX_WEIGHTS", limit)
            monkeypatch.setattr(step, "LARGE_SHARED_MAX_ROWS", shared_rows)
            model = synthetic_model("qwen3-tiny", bits=4, dtype=mx.bfloat16, seed=4)
            report = mlx_fastops.patch(model)
            assert [(e.status, e.reason) for e in report.entries if e.fusion == "compile"] == [("fused", note)]
            launched.clear()
            logits.append(fidelity.forced_logits(model, prompt, [7, 99, 1234]))
            assert launched == launches
            mlx_fastops.unpatch(model)
    finally:
        mx.enable_compile()
    assert np.isfinite(np.asarray(logits[0])).all()
    assert all(mx.array_equal(logits[0], other) for other in logits[1:])


def test_launch_runs(monkeypatch):
    """Consecutive groupable layers of one launch key share a launch at any row count; a layer that
    is not groupable, or of another key, starts a new launch; large layers of one key share one in
    steps of up to LARGE_SHARED_MAX_ROWS rows; no launch takes over MAX_LAYERS_PER_LAUNCH."""
    from types import SimpleNamespace
    keys = [1, 1, 1, 1, 1, 1, 1, 2, 2, 2]
    fasts = [SimpleNamespace(grouped=i not in (0, 9), launch_key=lambda k=k: k) for i, k in enumerate(keys)]
    large = [SimpleNamespace(grouped=False, launch_key=lambda k=k: k) for k in keys]
    mixed = [(0, 1), (1, 6), (7, 2), (9, 1)]
    apart = [(i, 1) for i in range(10)]
    for shared_rows, rows, runs, large_runs in ((1, 1, mixed, [(0, 7), (7, 3)]), (1, 2, mixed, apart),
                                                (0, 1, mixed, apart), (4, 4, mixed, [(0, 7), (7, 3)]),
                                                (4, 8, mixed, apart)):
        monkeypatch.setattr(step, "LARGE_SHARED_MAX_ROWS", shared_rows)
        assert step.launch_runs(fasts, rows) == runs
        assert step.launch_runs(large, rows) == large_runs
    monkeypatch.setattr(step, "MAX_LAYERS_PER_LAUNCH", 4)   # NVRTC's bound on kernel parameters
    assert step.launch_runs(fasts, 1) == [(0, 1), (1, 4), (5, 2), (7, 2), (9, 1)]
    assert step.launch_runs(large, 1) == [(0, 4), (4, 3), (7, 3)]


@pytest.mark.parametrize("limit,grouped", [(1.0, True), (0.99, False)])
def test_layers_grouped_by_layer_size(limit, grouped, monkeypatch):
    """Layers of up to GROUP_MAX_WEIGHTS may share a launch (where the H200 measured it faster;
    the limit is set here relative to the tiny layer's size)."""
    from mlx_fastops import synthetic_model
    import mlx_fastops

    monkeypatch.setenv("MLX_FASTOPS_BACKEND", "cuda")
    model = synthetic_model("qwen3-tiny", bits=4, dtype=mx.bfloat16)
    c = model.args
    D = c.head_dim
    weights = c.hidden_size * (D * (c.num_attention_heads + 2 * c.num_key_value_heads) + 3 * c.intermediate_size) \
        + D * c.num_attention_heads * c.hidden_size
    monkeypatch.setattr(block, "GROUP_MAX_WEIGHTS", int(limit * weights))
    report = mlx_fastops.patch(model, disable=("compile",))   # the emulator cannot be traced
    try:
        fb = model.model.layers[0].fast_fn
        assert fb.weights == weights and fb.grouped is grouped
        entries = [e for e in report.entries if e.fusion == "fast_decode"]
        assert len(entries) == c.num_hidden_layers and all(e.status == "fused" for e in entries)
    finally:
        mlx_fastops.unpatch(model)
