"""Projections of prefill-sized calls (more than PREFILL_MIN_ROWS rows) on tensor cores: the 4/8-bit
weights dequantised into a transient matrix in the activations' dtype, then MLX's dense matmul.

    y = x @ (s * q + b)^T  (+ bias)

On the H200 MLX's quantized_matmul runs prefill GEMMs at 15-25% of what its dense matmul reaches on
the same shapes (69-133 vs 239-641 TFLOP/s; docs/cuda-design.md). The transient weight is one more
write and read of N x K half-precision values per call, small beside an M x N x K product once M is
in the hundreds. Outputs wider than CHUNK_ELEMS weights (lm_head: the vocabulary) are dequantised
and multiplied a slice of rows at a time, so no call holds more than one slice, the size of a
decoder layer's largest projection, at once.
"""

import mlx.core as mx

PREFILL_MIN_ROWS = 64          # fewer rows stay on quantized_matmul
CHUNK_ELEMS = 4096 * 24576     # Qwen3-8B's gate/up: the largest weight a slice may hold


def dense(w, lo=0, hi=None):
    """Rows lo..hi of the PackedLinear's weight, dequantised in its scales' dtype."""
    hi = w.out_features if hi is None else hi
    return mx.dequantize(w.weight[lo:hi], w.scales[lo:hi], w.biases[lo:hi], group_size=w.group_size, bits=w.bits)


def linear(x, w):
    """x [..., K] @ W^T (+ bias) for a quantised PackedLinear, through dense matmuls."""
    N, K = w.out_features, w.in_features
    step = max(CHUNK_ELEMS // K, 1)
    if N <= step:
        y = x @ dense(w).T
    else:
        y = mx.concatenate([x @ dense(w, lo, min(lo + step, N)).T for lo in range(0, N, step)], axis=-1)
    return y if w.bias is None else y + w.bias
