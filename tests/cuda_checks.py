"""Checks the CUDA kernel tests share (tests/test_cuda_kernels.py, test_cuda_layer.py,
test_cuda_launches.py, test_cuda_quantized_kv.py)."""

import contextlib

import mlx.core as mx
import numpy as np

from mlx_fastops import kernels
from mlx_fastops.backends.cuda import gemv as G
from mlx_fastops.backends.cuda.phases import STAMP_COLS

# Stock MLX ops are a second opinion, on the GPU only (within ~1-2% there); the float32 oracle is
# the first. MLX's CPU backend adds bf16 quantised matmuls up in bf16: 3-5% off at K >= 1024.
ON_GPU = mx.cuda.is_available()


def rel(a, b):
    a = np.asarray(a.astype(mx.float32)).astype(np.float64)
    b = np.asarray(b.astype(mx.float32)).astype(np.float64)
    assert np.isfinite(a).all(), "non-finite output"
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


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


def assert_marks_in_order(st):
    """Every block that marked (an attention split past the valid length exits before its wait) took
    its entry, marks and end in this order: strictly on the emulator (a tick per reading), on the GPU
    within %globaltimer's steps (32 ns: a TILE8 phase's wait and first step can share one)."""
    marked = st[(st[:, 3:] != 0).all(axis=1)]
    steps = np.diff(marked[:, [0, *range(3, STAMP_COLS), 1]], axis=1)
    assert len(marked) and ((steps >= 0) if ON_GPU else (steps > 0)).all(), "marks out of order"
