"""Projections of prefill-sized calls (PREFILL_MIN_ROWS rows or more) on tensor cores: the stacked
4/8-bit weights dequantised into a transient matrix in the activations' dtype, then MLX's dense
matmul.

    y = x @ (s * q + b)^T  (+ bias)

On the H200 MLX's quantized_matmul runs prefill GEMMs at 15-25% of what its dense matmul reaches on
the same shapes; dequantise + matmul is 1.6-3.8x quantized_matmul at 2048 rows, 2.9-5.4x at 8192,
but 0.4-0.5x at 64 and 0.6-1.3x at 256 (benchmarks/results/cuda_prefill.md), hence the bound. The
transient weight is made after the matmul's input: it depends on nothing else, and MLX would
otherwise dequantise every layer's weights of a prompt chunk up front and hold them all at once.
"""

import mlx.core as mx

PREFILL_MIN_ROWS = 512   # fewer rows stay on quantized_matmul


def dense(w, after=None):
    """The PackedLinear's weight dequantised in its scales' dtype; with `after` (an array), made
    only once `after` is."""
    q = w.weight if after is None else mx.depends(w.weight, after)
    return mx.dequantize(q, w.scales, w.biases, group_size=w.group_size, bits=w.bits)


def linear(x, w):
    """x [..., K] @ W^T (+ bias) for a quantised PackedLinear, through a dense matmul."""
    y = x @ dense(w, after=x).T
    return y if w.bias is None else y + w.bias
