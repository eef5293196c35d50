"""The QKV projection's head epilogue (cuda/head.cuh: q/k RMSNorm + RoPE, k/v written into the
cache in place) as qmm's EPI 3 (qmm.qmm_head, FastBlock.wide's QKV), against MLX's own ops on the
projection's rows (qmm's EPI 0 output for the same x and weights, which EPI 3 computes alike):
mx.fast.rms_norm, mx.fast.rope at each row's position (off + l, minus the row's left padding over a
batch cache), the cache buffers' other positions untouched (poisoned beforehand). q and k within 2
units in the last place of the head's largest value (both RoPEs are fp32 with precise cos/sin; theta
may differ in its last bits), v exact. Over 16 rows the tokens span several blocks of the grid.

On a GPU: `pytest -m cuda`; elsewhere through the CPU emulator of tests/cuda_emu.
"""

import math

import mlx.core as mx
import numpy as np
import pytest

from mlx_fastops.backends.cuda.qmm import qmm, qmm_head
from mlx_fastops.backends.cuda.source import PAD_WORDS, offset_array
from mlx_fastops.ops.weights import PackedLinear

pytestmark = [pytest.mark.cuda]
F16, BF16, F32 = mx.float16, mx.bfloat16, mx.float32
ULP = {F16: 2 ** -10, BF16: 2 ** -7}
K = 256   # the projection's input features: two of qmm's 4-bit chunks


def projection(B, L, N, dtype, bias=None):
    """x [B, L, K] and a 4-bit QKV weight of N rows (+ bias [N]), and the rows qmm projects them to
    [B, L, N]."""
    wq, s, b = mx.quantize(mx.random.normal((N, K)) * 0.3, group_size=64, bits=4)
    w = PackedLinear(wq, s.astype(dtype), b.astype(dtype), None if bias is None else bias.astype(dtype), (N,), K, 4, 64)
    x = mx.random.normal((B, L, K)).astype(dtype)
    qkv = qmm(x, w)
    mx.eval(x, qkv)
    return x, w, qkv


CASES = [  # B, L, H, HKV, D, q/k norm, rope frequencies given, traditional, left padding, dtype
    (9, 1, 4, 2, 64, True, False, False, (0, 3, 1, 0, 5, 2, 0, 0, 7), BF16),   # Qwen3, a batch cache
    (17, 1, 8, 2, 128, True, False, False, None, F16),             # two token blocks, the second of 1 row
    (20, 1, 4, 2, 128, True, False, False, tuple(range(20)), BF16),  # a batch cache over two token blocks
    (5, 3, 4, 4, 64, False, True, False, (2, 0, 1, 0, 4), BF16),   # Llama 3 (frequencies), 3 tokens a row
    (12, 1, 6, 2, 64, False, False, True, None, BF16),             # traditional RoPE, no norm
    (3, 2, 2, 1, 256, True, False, False, (1, 0, 2), F16),          # head_dim 256, GQA 2
]


def _rope(x, pos, D, trad, base, scale, freqs):
    """x [1, heads, L, D] at positions pos .. pos + L - 1, through mx.fast.rope."""
    if freqs is not None:
        return mx.fast.rope(x, D, traditional=trad, base=None, scale=scale, offset=pos, freqs=freqs)
    return mx.fast.rope(x, D, traditional=trad, base=base, scale=scale, offset=pos)


@pytest.mark.parametrize("B,L,H,HKV,D,qknorm,with_freqs,trad,lpad,dtype", CASES)
def test_head_matches_mlx_ops(B, L, H, HKV, D, qknorm, with_freqs, trad, lpad, dtype, on_gpu):
    base, scale, qeps, keps, S, off = 1e6, 1.0, 1e-6, 0.5, 48, 29   # epsilons apart enough to tell
    N = (H + 2 * HKV) * D
    x, w, qkv = projection(B, L, N, dtype, None if qknorm else 0.5 * mx.random.normal((N,)))   # a bias: Qwen2
    qn, kn = (1 + 0.2 * mx.random.normal((D,))).astype(dtype), (1 + 0.2 * mx.random.normal((D,))).astype(dtype)
    freqs = (base ** (mx.arange(0, D, 2) / D) * (1 + mx.arange(D // 2) / D)).astype(F32) if with_freqs else None
    kc, vc = mx.full((B, HKV, S, D), 7e3, dtype), mx.full((B, HKV, S, D), -7e3, dtype)   # poison
    mx.eval(qn, kn, kc, vc)
    head = (("D", D), ("H", H), ("HKV", HKV), ("freqs", with_freqs), ("keps", keps), ("log2_base", math.log2(base)),
            ("qeps", qeps), ("qknorm", qknorm), ("scale", scale), ("trad", trad), ("L", L))
    arrays = dict(off=offset_array(off), kc=kc, vc=vc, after=kc)
    if qknorm:
        arrays.update(qn=qn, kn=kn)
    if with_freqs:
        arrays["rf"] = freqs
    if lpad is not None:
        head += (("lpad", True),)
        arrays["lp"] = mx.array(list(lpad) + [0] * max(0, PAD_WORDS - B), dtype=mx.int32)
    q = qmm_head(x, w, head, arrays)
    mx.eval(q)
    got_q, got_k, got_v = (np.asarray(a.astype(F32)) for a in (q, kc, vc))

    qs, ks, vs = mx.split(qkv, [H * D, (H + HKV) * D], axis=-1)
    qs, ks = qs.reshape(B, L, H, D), ks.reshape(B, L, HKV, D)
    if qknorm:
        qs, ks = mx.fast.rms_norm(qs, qn, qeps), mx.fast.rms_norm(ks, kn, keps)
    # RoPE's outputs are differences of products: within 2 units in the last place of the row's largest
    close = lambda got, want: (np.abs(got - want) <= 2 * ULP[dtype] * np.abs(want).max()).all()
    for b in range(B):
        pos = off - (lpad[b] if lpad is not None else 0)
        rq = _rope(qs[b:b + 1].transpose(0, 2, 1, 3), pos, D, trad, base, scale, freqs).transpose(0, 2, 1, 3)
        rk = _rope(ks[b:b + 1].transpose(0, 2, 1, 3), pos, D, trad, base, scale, freqs)[0]
        want_q, want_k = np.asarray(rq[0].astype(F32)), np.asarray(rk.astype(F32))
        want_v = np.asarray(vs[b].reshape(L, HKV, D).transpose(1, 0, 2).astype(F32))
        assert close(got_q[b], want_q), b
        assert close(got_k[b, :, off:off + L], want_k), b
        assert np.array_equal(got_v[b, :, off:off + L], want_v), b
    # the cache's other positions are untouched
    for got, poison in ((got_k, 7e3), (got_v, -7e3)):
        rest = np.concatenate([got[:, :, :off], got[:, :, off + L:]], axis=2)
        assert (rest == np.float32(mx.array(poison, dtype).item())).all()


def quantize_as_cuda(x, group, bits):
    """mx.quantize's affine rule on MLX's CUDA backend (its affine_quantize kernel, 0.32), in numpy:
    x [..., D] -> (packed uint32 [..., D * bits / 32], scales, biases [..., D / group] as float32
    of x's dtype). Differs from the CPU backend's (true max, round half to even)."""
    xf = np.asarray(x.astype(F32))
    shape = xf.shape
    g = xf.reshape(-1, group)
    lo, hi = g.min(1), np.maximum(g.max(1), np.float32(0))
    nbins = np.float32(2 ** bits - 1)
    round_away = lambda v: (np.sign(v) * np.floor(np.abs(v.astype(np.float64)) + 0.5)).astype(np.float32)
    scale = np.maximum((hi - lo) / nbins, np.float32(1e-7))
    side = np.abs(lo) > np.abs(hi)
    scale = np.where(side, scale, -scale)
    edge = np.where(side, lo, hi)
    q0 = round_away(edge / scale)
    at_zero = q0 == 0
    scale = np.where(at_zero, scale, edge / np.where(at_zero, np.float32(1), q0)).astype(np.float32)
    bias = np.where(at_zero, np.float32(0), edge).astype(np.float32)
    q = np.clip(round_away((g - bias[:, None]) / scale[:, None]), 0, nbins).astype(np.uint64)
    per = 32 // bits
    q = q.reshape(-1, per) << (np.arange(per, dtype=np.uint64) * bits)
    words = q.sum(1).astype(np.uint32).reshape(*shape[:-1], -1)
    rounded = lambda a: np.asarray(mx.array(a).astype(x.dtype).astype(F32)).reshape(*shape[:-1], -1)
    return words, rounded(scale), rounded(bias)


QUANTIZED_CASES = [  # B, L, H, HKV, D, q/k norm, dtype, kv_bits, kv group size
    (1, 1, 4, 2, 64, True, BF16, 8, 64),
    (2, 3, 8, 2, 128, True, F16, 4, 32),
    (1, 2, 4, 1, 256, False, BF16, 8, 128),
    (3, 1, 4, 4, 128, True, BF16, 4, 64),
]


@pytest.mark.parametrize("B,L,H,HKV,D,qknorm,dtype,bits,group", QUANTIZED_CASES)
def test_head_quantises_into_the_cache(B, L, H, HKV, D, qknorm, dtype, bits, group, on_gpu):
    """Over a quantised cache (head "kv"): q as over the float cache, bit for bit, and each new k/v
    row quantised as mx.quantize does on the CUDA backend (quantize_as_cuda; on a GPU also
    mx.quantize itself) from the float path's rows, into the packed arrays at off + l; the other
    positions untouched. Some value groups are all negative (the CUDA rule's maximum starts at 0)."""
    S, off = 40, 21
    N = (H + 2 * HKV) * D
    negative = (mx.arange(N) >= (H + HKV) * D) & ((mx.arange(N) // group) % 3 == 1)   # some v groups
    x, w, qkv = projection(B, L, N, dtype, mx.where(negative, -100.0, 0.0))   # |rows| < 100 at K = 256
    assert (np.asarray(qkv.astype(F32)).reshape(-1, N)[:, np.asarray(negative)] < 0).all()
    qn, kn = (1 + 0.2 * mx.random.normal((D,))).astype(dtype), (1 + 0.2 * mx.random.normal((D,))).astype(dtype)
    head = (("D", D), ("H", H), ("HKV", HKV), ("freqs", False), ("keps", 1e-6), ("log2_base", math.log2(1e6)),
            ("qeps", 1e-6), ("qknorm", qknorm), ("scale", 1.0), ("trad", False), ("L", L))
    norms = dict(qn=qn, kn=kn) if qknorm else {}
    kc, vc = mx.zeros((B, HKV, S, D), dtype), mx.zeros((B, HKV, S, D), dtype)
    q_float = qmm_head(x, w, head, dict(off=offset_array(off), kc=kc, vc=vc, after=kc, **norms))
    mx.eval(q_float)
    poison = lambda w, t: mx.full((B, HKV, S, w), 77, t)
    packed = {f"{kv}_{part}": poison(w, t) for kv in "kv"
              for part, w, t in (("w", D * bits // 32, mx.uint32), ("s", D // group, dtype), ("b", D // group, dtype))}
    mx.eval(*packed.values())
    q = qmm_head(x, w, head + (("kv", (bits, group)),), dict(off=offset_array(off), after=qkv, **packed, **norms))
    mx.eval(q)
    assert mx.array_equal(q, q_float)
    for kv, rows in (("k", kc), ("v", vc)):
        new = rows[:, :, off:off + L]
        want = quantize_as_cuda(new, group, bits)
        got = [np.asarray(packed[f"{kv}_{p}"].astype(mx.uint32 if p == "w" else F32)) for p in "wsb"]
        for g, w in zip(got, want):
            assert np.array_equal(g[:, :, off:off + L], w), kv
            rest = np.concatenate([g[:, :, :off], g[:, :, off + L:]], axis=2)
            assert (rest == 77).all(), kv
        if on_gpu:
            for g, w in zip(got, mx.quantize(new, group_size=group, bits=bits)):
                w = np.asarray(w.astype(mx.uint32 if w.dtype == mx.uint32 else F32))
                assert np.array_equal(g[:, :, off:off + L], w), kv
