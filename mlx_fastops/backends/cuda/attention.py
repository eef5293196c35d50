"""GQA decode attention over the KV cache buffers (cuda/attention.cu), split over the sequence.

    o[b, l, h] = sum_s softmax_s(q[b, l, h] . k[b, h / G, s] * scale) v[b, h / G, s],
    s <= off + l (causal over this step's L new tokens, which sit at off .. off + L - 1)

Each (b, l, kv head, head subgroup) row is split into chunks of at least ATTN_MINCH positions,
one block each; the last block of a row to finish (a ticket) merges the partial softmaxes.
The cache is read in place through its strides (mlx-lm's KVCache buffers, with room to grow).
"""

import mlx.core as mx

from ...kernels import cached_builder, cuda_kernel
from .. import reference
from .source import HALF, OFF_WORDS, kernel_name, offset_array, source

ATTN_WARPS = 4        # warps per attention block
ATTN_MINCH = 16       # fewest positions per split
ATTN_MAX_SPLITS = 64  # the merge's shared weights table (MAXSPLIT in attention.cu)
# Four blocks per SM on the H200's 132 SMs (the layer launch's every slot): at 8192 positions a
# chunk per block half as long as with 264 (docs/cuda-design.md, Attention); 792 or more: slower.
ATTN_TARGET_BLOCKS = 528
MAX_GQA = 8    # query heads per kv head held in registers by the attention kernel
LOG2E = 1.4426950408889634


def attn_splits(S, rows):
    """Splits per (b, l, kv head): as many as keep the blocks within ATTN_TARGET_BLOCKS (one wave:
    more were slower), no more than a cache buffer of S slots can use (S None: no such bound;
    splits past the valid length are empty)."""
    want = ATTN_TARGET_BLOCKS // rows
    usable = ATTN_MAX_SPLITS if S is None else min(ATTN_MAX_SPLITS, -(-S // ATTN_MINCH))
    return max(1, min(want, usable))


def attn_partials(rows, S, G, gb, D):
    """(splits, shapes of the partials pm and po) of an attention launch over `rows` (b, l, kv head)
    triples, each split further into G / gb head subgroups, over cache buffers of S slots (None: see
    attn_splits)."""
    nsplit = attn_splits(S, rows * G // gb)
    return nsplit, [(rows, nsplit, G, 2), (rows, nsplit, G, D)]


def attn_defines(L, H, HKV, D, scale, gb=None):
    """gb: query heads per block (a divisor of G = H / HKV; default G)."""
    G = H // HKV
    return dict(L=L, H=H, HKV=HKV, D=D, G=G, GB=gb or G, NW=ATTN_WARPS, MINCH=ATTN_MINCH,
                SCALE_LOG2=f"{float(scale) * LOG2E!r}f")


def head_subgroup(G):
    """Query heads per attention block in the one-launch layer: 2 where G is even (the K/V chunk is
    read once per pair of heads), else 1. All of an odd G in a block took the launch over 128
    registers (offline ptxas: G = 5 166 at one row, G = 7 255, G = 3 137 at 2 rows and 223 at 8) and
    its staged x out of shared memory; one a block was 1.29-3.80x faster on G = 5 and 7 (design doc,
    "Attention")."""
    return 2 if G % 2 == 0 else 1


@cached_builder
def _attn_kernel(dtype, L, H, HKV, D, scale, gb, lpad):
    d = attn_defines(L, H, HKV, D, scale, gb)
    if lpad:
        d["LEFT_PAD"] = 1
    src = source("attention.cu", d, dtype)
    names = ["q", "kc", "vc", "off"] + (["lp"] if lpad else []) + ["cnt"]
    return cuda_kernel(name=kernel_name("attn", src), input_names=names,
                       output_names=["o", "pm", "po"], source=src, ensure_row_contiguous=False)


def attention(q, kc, vc, off, scale, cnt=None, gb=None, lp=None):
    """q [B, L, H, D] (contiguous), kc/vc [B, HKV, S, D] cache buffers (read by strides; last axis
    contiguous), off int32[OFF_WORDS] (positions before this step in [0]) -> [B, L, H, D].
    cnt: int32 tickets, at least B*L*H, all zero (left zero). gb: query heads per block. lp: a
    batch cache's left padding (int32 per row, at least PAD_WORDS): row b attends from lp[b]."""
    B, L, H, D = q.shape
    HKV, S = kc.shape[1], kc.shape[2]
    G = H // HKV
    gb = gb or G
    rows = B * L * HKV
    if cnt is None:
        # Calls from unrelated places may run concurrently in one CUDA graph: fresh tickets each
        # (a tiny fill kernel that the attention waits for).
        cnt = mx.zeros((max(rows * G // gb, 4),), dtype=mx.int32)
    kern = _attn_kernel(q.dtype, L, H, HKV, D, float(scale), gb, lp is not None)
    nsplit, partials = attn_partials(rows, S, G, gb, D)
    inputs = [q, kc, vc, off] + ([lp] if lp is not None else []) + [cnt]
    o, _, _ = kern(inputs=inputs, output_shapes=[(B, L, H, D), *partials],
                   output_dtypes=[q.dtype, mx.float32, mx.float32],
                   grid=(nsplit * ATTN_WARPS * 32, HKV * G // gb, B * L), threadgroup=(ATTN_WARPS * 32, 1, 1))
    return o


def unsupported_decode_attention(head_dim=None, gqa=None, dtype=None, **_):
    if head_dim not in (64, 128, 256):
        return f"head_dim {head_dim}"
    if gqa is None or not 1 <= gqa <= MAX_GQA:
        return f"GQA group {gqa} (1-{MAX_GQA})"
    if dtype is not None and dtype not in HALF:
        return f"dtype {dtype}"
    return None


def decode_attention(q, k_cache, v_cache, length, scale):
    B, H, L, D = q.shape
    if (L != 1 or q.dtype not in HALF or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype
            or v_cache.shape != k_cache.shape
            or unsupported_decode_attention(D, H // k_cache.shape[1])):
        return reference.decode_attention(q, k_cache, v_cache, length, scale)
    if isinstance(length, mx.array):
        off = mx.pad((length.reshape(1) - 1).astype(mx.int32), (0, OFF_WORDS - 1))
    else:
        if not 0 < int(length) <= k_cache.shape[2]:
            raise ValueError(f"decode_attention: length {length} outside the cache (1..{k_cache.shape[2]})")
        off = offset_array(int(length) - 1)
    q4 = mx.contiguous(q).reshape(B, 1, H, D)
    return attention(q4, k_cache, v_cache, off, scale).reshape(B, H, 1, D)
