"""Metal attention: GQA decode attention (metal/attention.metal) and prefill flash attention
(metal/flash_attention.metal).

  decode_attention(q [B,H,1,D], k_cache, v_cache [B,Hkv,S_alloc,D], length, scale) -> [B,H,1,D]
      reads the cache buffers in place (ensure_row_contiguous=False; `length` is a 0-d int32 input,
      never a template argument); one threadgroup per (chunk of keys, KV head, batch) serving all
      G query heads of the KV head; split over the sequence with a reduce kernel when the context is
      long enough to need more threadgroups than B * Hkv;
  flash_attention(q [B,H,qL,D], k, v [B,Hkv,kL,D], scale, mask) -> [B,H,qL,D]
      mask None or "causal" (lower-right aligned); an array mask runs the reference op. The result
      is written as [B, qL, H, D] and returned as a transposed view, so o_proj's
      transpose + reshape costs no copy.

Both take any strides for q/k/v (mlx-lm hands over transposed views and cache slices).
"""

import mlx.core as mx

from ... import kernels
from .. import reference

ATTN_SOURCE = "attention.metal"
FLASH_SOURCE = "flash_attention.metal"
HEAD_DIMS = (64, 128, 256)
MAX_GQA = 8
_FLOATS = (mx.float16, mx.bfloat16, mx.float32)

# Split-K policy of decode attention: aim at about TARGET_TGS threadgroups, never fewer than
# MIN_CHUNK keys a threadgroup, at most MAX_CHUNKS chunks; one chunk = one kernel, no reduce.
TARGET_TGS = 128
MIN_CHUNK = 128
MAX_CHUNKS = 128


def sections(filename):
    """{section name: text} of a sectioned metal/*.metal file (see kernels.sections)."""
    return kernels.sections("metal", filename)


def _check_info(head_dim=None, gqa=None, dtype=None):
    if head_dim is not None and head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} (kernel: {HEAD_DIMS})"
    if gqa is not None and not 1 <= gqa <= MAX_GQA:
        return f"GQA group size {gqa} (kernel: 1..{MAX_GQA})"
    if dtype is not None and dtype not in _FLOATS:
        return f"dtype {dtype}"
    return None


# ---------------------------------------------------------------------------------------------
# decode


def decode_nsg(head_dim, gqa):
    """SIMD-groups a decode threadgroup: as many as fit NSG * G * D floats in 16 KiB, 1..8."""
    return max(1, min(8, 4096 // (gqa * head_dim)))


def decode_chunks(length, batch_kv_heads):
    """(n_chunks, keys per chunk) for a context of `length` keys over B * Hkv KV heads."""
    want = max(1, TARGET_TGS // max(1, batch_kv_heads))
    n = min(-(-length // MIN_CHUNK), want, MAX_CHUNKS)
    if n <= 1:
        return 1, length
    chunk = -(-length // n)
    return -(-length // chunk), chunk


@kernels.cached_builder
def _decode_kernel(dtype, split):
    s = sections(ATTN_SOURCE)
    tail = s["decode_tail_split" if split else "decode_tail_single"]
    return kernels.metal_kernel(
        name=f"fastops_decode_attention_{'split' if split else 'single'}_{kernels.dtype_tag(dtype)}",
        input_names=["q", "k", "v", "kv_len", "kv_chunk", "scale"],
        output_names=["o_part", "m_part", "l_part"] if split else ["out"],
        source=s["decode_common"] + tail,
        header=s["header"],
        ensure_row_contiguous=False,  # the cache buffers, read in place
    )


@kernels.cached_builder
def _reduce_kernel(dtype):
    s = sections(ATTN_SOURCE)
    return kernels.metal_kernel(
        name=f"fastops_decode_reduce_{kernels.dtype_tag(dtype)}",
        input_names=["o_part", "m_part", "l_part"],
        output_names=["out"],
        source=s["decode_reduce"],
        header=s["header"],
    )


def unsupported_decode_attention(head_dim=None, gqa=None, dtype=None, **_):
    return _check_info(head_dim, gqa, dtype)


def decode_attention(q, k_cache, v_cache, length, scale):
    B, H, L, D = q.shape
    Hk = k_cache.shape[1]
    length = int(length)
    if (L != 1 or H % Hk or _check_info(D, H // Hk, q.dtype) or k_cache.dtype != q.dtype
            or v_cache.dtype != q.dtype or v_cache.shape != k_cache.shape or not 0 < length <= k_cache.shape[2]):
        return reference.decode_attention(q, k_cache, v_cache, length, scale)
    G = H // Hk
    nsg = decode_nsg(D, G)
    n_chunks, chunk = decode_chunks(length, B * Hk)
    split = n_chunks > 1
    template = [("T", q.dtype), ("D", D), ("G", G), ("NSG", nsg)]
    common = dict(inputs=[q, k_cache, v_cache, mx.array(length, dtype=mx.int32),
                          mx.array(chunk, dtype=mx.int32), float(scale)],
                  template=template, grid=(32 * nsg * n_chunks, Hk, B), threadgroup=(32 * nsg, 1, 1))
    if not split:
        return _decode_kernel(q.dtype, False)(output_shapes=[(B, H, 1, D)], output_dtypes=[q.dtype],
                                              **common)[0]
    o_part, m_part, l_part = _decode_kernel(q.dtype, True)(
        output_shapes=[(B, H, n_chunks, D), (B, H, n_chunks), (B, H, n_chunks)],
        output_dtypes=[mx.float32] * 3, **common)
    rows = B * H
    out = _reduce_kernel(q.dtype)(
        inputs=[o_part, m_part, l_part], template=[("T", q.dtype), ("D", D)],
        grid=(32, rows, 1), threadgroup=(32, min(4, rows), 1),
        output_shapes=[(B, H, 1, D)], output_dtypes=[q.dtype])[0]
    return out


# ---------------------------------------------------------------------------------------------
# prefill

Q_TILE = 16
FLASH_THREADS = 128  # 4 SIMD-groups


@kernels.cached_builder
def _flash_kernel(dtype, quant=False):
    s = sections(FLASH_SOURCE)
    kv = ["k", "k_scales", "k_biases", "v", "v_scales", "v_biases"] if quant else ["k", "v"]
    return kernels.metal_kernel(
        name=f"fastops_flash_attention{'_q8' if quant else ''}_{kernels.dtype_tag(dtype)}",
        input_names=["q", *kv, "scale"],
        output_names=["out"],
        source=s["loads_q8" if quant else "loads_float"] + s["flash_attention"],
        header=s["header"],
        ensure_row_contiguous=False,  # transposed q views and cache slices, read in place
    )


def unsupported_flash_attention(head_dim=None, gqa=None, dtype=None, mask=None, **_):
    if mask == "array":
        return "array masks (the kernel takes None or 'causal')"
    return _check_info(head_dim, gqa, dtype)


def flash_attention(q, k, v, scale, mask=None):
    _, H, qL, D = q.shape
    Hk, kL = k.shape[1], k.shape[2]
    if (isinstance(mask, mx.array) or H % Hk or _check_info(D, H // Hk, q.dtype) or k.dtype != q.dtype
            or v.dtype != q.dtype or v.shape != k.shape or kL == 0 or qL == 0):
        return reference.flash_attention(q, k, v, scale, mask)
    return _launch_flash(_flash_kernel(q.dtype), q, [k, v], scale, mask == "causal", [])


def _launch_flash(kernel, q, kv_inputs, scale, causal, extra_template):
    """One threadgroup per (Q_TILE queries, head, batch); the output is written [B, qL, H, D], so
    the transpose back to [B, H, qL, D] is a view that o_proj's reshape reads without a copy."""
    B, H, qL, D = q.shape
    out = kernel(
        inputs=[q, *kv_inputs, float(scale)],
        template=[("T", q.dtype), ("D", D), ("CAUSAL", causal), *extra_template],
        grid=(FLASH_THREADS * (-(-qL // Q_TILE)), H, B),
        threadgroup=(FLASH_THREADS, 1, 1),
        output_shapes=[(B, qL, H, D)],
        output_dtypes=[q.dtype],
    )[0]
    return out.transpose(0, 2, 1, 3)


# ---------------------------------------------------------------------------------------------
# prefill over an int8 KV cache (mlx-lm's QuantizedKVCache, kv_bits=8)

Q8_GROUPS = (32, 64, 128)


def unsupported_flash_attention_q8(head_dim=None, gqa=None, dtype=None, mask=None, bits=8, group_size=64, **_):
    if bits != 8:
        return f"kv_bits={bits} (kernel: 8)"
    if group_size not in Q8_GROUPS or (head_dim is not None and head_dim % group_size):
        return f"kv group size {group_size} with head_dim {head_dim}"
    return unsupported_flash_attention(head_dim, gqa, dtype, mask)


def flash_attention_q8(q, q_keys, q_values, scale, mask=None, group_size=64, bits=8):
    """Flash attention over mlx-lm's QuantizedKVCache tuples (packed uint32, scales, biases).

    Same contract as mlx_lm.models.base.quantized_scaled_dot_product_attention: q [B,H,qL,D],
    q_keys / q_values = (w [B,Hkv,kL,D/4] uint32, scales, biases [B,Hkv,kL,D/group_size]) ->
    [B,H,qL,D]. K/V are dequantised per 8x8 MMA step inside the kernel; nothing is materialised.
    Array masks and other bit widths run the stock quantized path. This is the Metal
    `quantized_attention` op (FusedAttention uses it whenever the cache is a QuantizedKVCache).
    """
    _, H, qL, D = q.shape
    kw, ks, kb = q_keys
    vw, vs, vb = q_values
    Hk, kL = kw.shape[1], kw.shape[2]
    if (isinstance(mask, mx.array) or H % Hk or kL == 0 or qL == 0
            or unsupported_flash_attention_q8(D, H // Hk, q.dtype, None, bits, group_size)
            or kw.dtype != mx.uint32 or vw.dtype != mx.uint32 or kw.shape[-1] * 4 != D or vw.shape[-1] * 4 != D
            or ks.dtype != q.dtype or vs.dtype != q.dtype or kb.dtype != q.dtype or vb.dtype != q.dtype
            # MLX passes inputs under 8 elements in `constant` memory; the body reads device pointers.
            or min(ks.size, kb.size, vs.size, vb.size) < 8):
        return reference.quantized_attention(q, q_keys, q_values, scale, mask, group_size, bits)
    return _launch_flash(_flash_kernel(q.dtype, True), q, [kw, ks, kb, vw, vs, vb], scale,
                         mask == "causal", [("GS", group_size)])
