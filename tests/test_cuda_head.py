"""The head kernel (cuda/head.cu: q/k RMSNorm + RoPE, k/v written into the cache in place) called
directly, against MLX's own ops on the same rows: mx.fast.rms_norm, mx.fast.rope at each row's
position (off + l, minus the row's left padding over a batch cache), the cache buffers' other
positions untouched (poisoned beforehand). q and k within 2 units in the last place of the head's
largest value (both RoPEs are fp32 with precise cos/sin; theta may differ in its last bits), v exact.

On a GPU: `pytest -m cuda`; elsewhere through the CPU emulator of tests/cuda_emu.
"""

import math

import mlx.core as mx
import numpy as np
import pytest

from mlx_fastops.backends.cuda.head import head_rows
from mlx_fastops.backends.cuda.source import PAD_WORDS, offset_array

pytestmark = [pytest.mark.cuda]
F16, BF16, F32 = mx.float16, mx.bfloat16, mx.float32
ULP = {F16: 2 ** -10, BF16: 2 ** -7}

CASES = [  # B, L, H, HKV, D, q/k norm, rope frequencies given, traditional, left padding, dtype
    (9, 1, 4, 2, 64, True, False, False, (0, 3, 1, 0, 5, 2, 0, 0, 7), BF16),   # Qwen3, a batch cache
    (17, 1, 8, 2, 128, True, False, False, None, F16),
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
    qkv = (3 * mx.random.normal((B, L, N))).astype(dtype)
    qn, kn = (1 + 0.2 * mx.random.normal((D,))).astype(dtype), (1 + 0.2 * mx.random.normal((D,))).astype(dtype)
    freqs = (base ** (mx.arange(0, D, 2) / D) * (1 + mx.arange(D // 2) / D)).astype(F32) if with_freqs else None
    kc, vc = mx.full((B, HKV, S, D), 7e3, dtype), mx.full((B, HKV, S, D), -7e3, dtype)   # poison
    mx.eval(qkv, qn, kn, kc, vc)
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
    q = head_rows(qkv, head, arrays)
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
