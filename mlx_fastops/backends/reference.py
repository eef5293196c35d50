"""Reference implementations composed from stock MLX ops: the oracle in every test, the CPU path.

Even here, what needs no kernel is fused: Q/K/V and gate/up are one matmul (or one
`mx.quantized_matmul`) on weights stacked along the output dimension.
"""

import mlx.core as mx
from mlx_lm.models.activations import swiglu
from mlx_lm.models.base import quantized_scaled_dot_product_attention

DECODE_PATH = None   # no whole-model decode path (mlx_fastops.backends.DecodePath)


def linear(x, w):
    """x @ W^T (+ bias) for a PackedLinear, exactly as nn.Linear / nn.QuantizedLinear compute it."""
    if w.quantized:
        y = mx.quantized_matmul(x, w.weight, w.scales, w.biases, transpose=True,
                                group_size=w.group_size, bits=w.bits)
        return y if w.bias is None else y + w.bias
    if w.bias is None:
        return x @ w.weight.T
    return mx.addmm(w.bias, x, w.weight.T)


def qkv_proj(x, w):
    nq, nk, _ = w.splits
    return tuple(mx.split(linear(x, w), [nq, nq + nk], axis=-1))


def gate_up_silu(x, w):
    gate, up = mx.split(linear(x, w), 2, axis=-1)
    return swiglu(gate, up)


lm_head = linear


def rms_norm_residual(x, residual, weight, eps):
    h = residual + x
    return h, mx.fast.rms_norm(h, weight, eps)


def _rope(x, rope, offset):
    return mx.fast.rope(x, rope.dims, traditional=rope.traditional, base=rope.base,
                        scale=rope.scale, offset=offset, freqs=rope.freqs)


def qk_norm_rope(q, k, q_norm, k_norm, eps, rope, offset):
    if q_norm is not None:
        q = mx.fast.rms_norm(q, q_norm, eps)
        k = mx.fast.rms_norm(k, k_norm, eps)
    q = _rope(q.transpose(0, 2, 1, 3), rope, offset)
    k = _rope(k.transpose(0, 2, 1, 3), rope, offset)
    return q, k


def decode_attention(q, k_cache, v_cache, length, scale):
    k = k_cache[..., :length, :]
    v = v_cache[..., :length, :]
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)


def flash_attention(q, k, v, scale, mask=None):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def quantized_attention(q, q_keys, q_values, scale, mask=None, group_size=64, bits=8):
    return quantized_scaled_dot_product_attention(q, q_keys, q_values, scale=scale, mask=mask,
                                                  group_size=group_size, bits=bits)
