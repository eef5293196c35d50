"""Attention over mlx-lm's QuantizedKVCache (`kv_bits`): a decode kernel reading the packed cache
(cuda/quantized_attention.cu), and prefill as MLX ops.

  quantized_attention(q [B,H,L,D], q_keys, q_values, scale, mask, group_size, bits) -> [B,H,L,D]
      q_keys / q_values: (packed uint32 [B,Hkv,S,D*bits/32], scales, biases [B,Hkv,S,D/group_size])

Stock mlx-lm computes this with mx.quantized_matmul, which has no CUDA kernel for several of
these shapes and bit widths (decode at kv_bits=8 raises). Here:
- up to DECODE_QUERIES query tokens (decode; mask None or "causal"): one launch that dequantises
  keys and values in registers (fp32 scores and sums), split over the sequence as the float
  decode attention (attention.py: the same split policy and partials); the cache's slices are
  read in place through their strides;
- more query tokens (prompts): mx.dequantize of the cache into the activation dtype, then
  mx.fast.scaled_dot_product_attention (its "causal" is lower-right aligned: the queries are the
  last L of the S positions).
A call the kernel does not take (unsupported_quantized_attention, or scales in another dtype)
runs the reference op, mlx-lm's own.
"""

import mlx.core as mx

from ...kernels import cached_builder, cuda_kernel
from .. import reference
from .attention import ATTN_WARPS, LOG2E, MAX_GQA, attn_defines, attn_partials
from .source import kernel_name, source

DECODE_QUERIES = 8   # query tokens per row that the kernel takes (decode, speculative verification)
KV_BITS = (4, 8)
KV_GROUPS = (32, 64, 128)
HEAD_DIMS = (64, 128, 256)
_FLOATS = (mx.float16, mx.bfloat16, mx.float32)


@cached_builder
def _kernel(dtype, L, H, HKV, D, scale, bits, group_size, causal):
    defines = {**attn_defines(L, H, HKV, D, scale), "BITS": bits, "GS": group_size, "CAUSAL": causal}
    src = source("quantized_attention.cu", defines, dtype)
    return cuda_kernel(name=kernel_name("qattn", src),
                       input_names=["q", "k_w", "k_s", "k_b", "v_w", "v_s", "v_b", "cnt"],
                       output_names=["o", "pm", "po"], source=src, ensure_row_contiguous=False)


def unsupported_quantized_attention(head_dim=None, gqa=None, dtype=None, bits=None, group_size=None, **_):
    if head_dim is not None and head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} (kernel: {', '.join(map(str, HEAD_DIMS))})"
    if gqa is not None and not 1 <= gqa <= MAX_GQA:
        return f"GQA group {gqa} (kernel: 1-{MAX_GQA})"
    if dtype is not None and dtype not in _FLOATS:
        return f"dtype {dtype}"
    if bits is not None and bits not in KV_BITS:
        return f"kv_bits={bits} (kernel: 4, 8)"
    if group_size is not None and group_size not in KV_GROUPS:
        return f"kv group size {group_size} (kernel: 32, 64, 128)"
    return None


def _decode(q, q_keys, q_values, scale, causal, group_size, bits):
    B, H, L, D = q.shape
    kw = q_keys[0]
    HKV, S = kw.shape[1], kw.shape[2]
    G, rows = H // HKV, B * L * HKV
    nsplit, partials = attn_partials(rows, S, G, G, D)
    # Fresh tickets each call (calls from unrelated places may share one CUDA graph); 16 bytes at
    # least: out of MLX's small managed pool (source.OFF_WORDS).
    cnt = mx.zeros((max(rows, 4),), dtype=mx.int32)
    kern = _kernel(q.dtype, L, H, HKV, D, float(scale), bits, group_size, causal)
    o, _, _ = kern(inputs=[mx.contiguous(q.transpose(0, 2, 1, 3)), *q_keys, *q_values, cnt],
                   output_shapes=[(B, L, H, D), *partials], output_dtypes=[q.dtype, mx.float32, mx.float32],
                   grid=(nsplit * ATTN_WARPS * 32, HKV, B * L), threadgroup=(ATTN_WARPS * 32, 1, 1))
    return o.transpose(0, 2, 1, 3)


def _dequantized(q, q_keys, q_values, scale, mask, group_size, bits):
    k, v = (mx.dequantize(*t, group_size=group_size, bits=bits) for t in (q_keys, q_values))
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def quantized_attention(q, q_keys, q_values, scale, mask=None, group_size=64, bits=8):
    B, H, L, D = q.shape
    HKV = q_keys[0].shape[1]
    if (isinstance(mask, mx.array) or H % HKV
            or unsupported_quantized_attention(D, H // HKV, q.dtype, bits, group_size) or D % group_size
            or any(a.dtype != q.dtype for a in (*q_keys[1:], *q_values[1:]))
            or q_values[0].shape != q_keys[0].shape):
        return reference.quantized_attention(q, q_keys, q_values, scale, mask, group_size, bits)
    if L <= DECODE_QUERIES:
        return _decode(q, q_keys, q_values, scale, mask is not None and L > 1, group_size, bits)
    return _dequantized(q, q_keys, q_values, scale, mask, group_size, bits)
