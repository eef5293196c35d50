"""Projections of prefill-sized calls (PREFILL_MIN_ROWS rows or more) on tensor cores: the stacked
4/8-bit weights dequantised into a transient matrix in the activations' dtype, then MLX's dense
matmul.

    y = x @ (s * q + b)^T  (+ bias)

On the H200 MLX's quantized_matmul runs prefill GEMMs at 15-25% of what its dense matmul reaches on
the same shapes; dequantise + matmul is 1.6-3.8x quantized_matmul at 2048 rows, 2.9-5.4x at 8192,
but 0.4-0.5x at 64 and 0.6-1.3x at 256 (benchmarks/results/cuda_prefill.md), hence the bound.

Memory: the transient weight is made after the matmul's input (it depends on nothing else, and MLX
would otherwise dequantise every layer's weights of a prompt chunk up front). That orders the work
but does not bound what is alive: the host encodes a whole chunk's layers long before the GPU has
run them, and a buffer goes back to the allocator only once the kernels that use it have run, so
every layer's transient (and activations) of the chunk would be held at once. So each call waits,
before returning, until the GPU has finished the call IN_FLIGHT_MAX calls back: the GPU always has
the last few layers queued (no idle gap), and at most that many transients are alive.

float32 activations: MLX runs float32 matmuls on a CUDA GPU in TF32 (about 1e-3 relative error per
product) unless MLX_ENABLE_TF32=0, where stock's quantized_matmul stays in float32; so there they
stay on quantized_matmul (measured on the H200: a float32 model's logits 1e-3 off stock's, dense).
"""

import os
from collections import deque
from functools import cache

import mlx.core as mx

from .source import rows

PREFILL_MIN_ROWS = 512   # fewer rows stay on quantized_matmul
IN_FLIGHT_MAX = 8        # prefill calls queued on the GPU at once (4 per decoder layer)

_in_flight = deque()     # one element of each recent call's output, submitted, oldest first


def takes(x, w):
    """Whether the dense path takes x @ w: PREFILL_MIN_ROWS rows or more, activations in the scales'
    dtype, and a matmul as precise as quantized_matmul in that dtype (not float32 in TF32)."""
    return (rows(x) >= PREFILL_MIN_ROWS and x.dtype == w.scales.dtype
            and not (x.dtype == mx.float32 and tf32_matmul()))


def tf32_matmul():
    """Whether MLX's float32 matmuls here run in TF32: on a CUDA GPU, unless MLX_ENABLE_TF32 is 0."""
    return mx.cuda.is_available() and mx.default_device().type == mx.gpu and _tf32_variable()


@cache
def _tf32_variable():
    # MLX's variable: an integer, default 1, read once (as MLX does: a later change does not reach it)
    try:
        return int(os.environ.get("MLX_ENABLE_TF32", "1")) != 0
    except ValueError:
        return True


def dense(w, after=None):
    """The PackedLinear's weight dequantised in its scales' dtype; with `after` (an array), made
    only once `after` is."""
    q = w.weight if after is None else mx.depends(w.weight, after)
    return mx.dequantize(q, w.scales, w.biases, group_size=w.group_size, bits=w.bits)


def pace(y):
    """Submit y and wait for the call IN_FLIGHT_MAX calls back. Inside a function transformation
    (mx.compile, vmap, grad), where nothing may be evaluated, y is left to the caller's graph."""
    mark = y.reshape(-1)[:1] + 0   # a copy: holding it does not hold y's buffer
    try:
        mx.async_eval(mark)
    except ValueError:
        return
    _in_flight.append(mark)
    while len(_in_flight) > IN_FLIGHT_MAX:
        mx.eval(_in_flight.popleft())


def linear(x, w):
    """x [..., K] @ W^T (+ bias) for a quantised PackedLinear, through a dense matmul."""
    y = x @ dense(w, after=x).T
    y = y if w.bias is None else y + w.bias
    pace(y)
    return y
