"""CUDA backend: mx.fast.cuda_kernel wrappers around cuda/*.cu, one kernel family a module.

Ops (the reference signatures, mlx_fastops.backends.reference; `unsupported_<op>(**info)` says why
a static shape class falls back to the reference):
  qkv_proj, gate_up_silu, lm_head   quantised GEMV for 1-8 activation rows (gemv.py), 9-64 rows
                                    on tensor cores (qmm.py); prefill-sized QKV and gate/up calls:
                                    dense matmuls on weights dequantised per call (prefill.py); the
                                    rest: stock quantized_matmul
  linear                            o_proj / down_proj: 9-64 rows on tensor cores, prefill-sized
                                    calls as above, the rest stock
  decode_attention                  GQA decode attention over the cache buffers (attention.py)
  quantized_attention               attention over mlx-lm's QuantizedKVCache: decode reads the packed
                                    4/8-bit cache in place; prompts dequantise it, then MLX's SDPA
                                    (quantized_kv.py)
Ops without a CUDA kernel (rms_norm_residual, qk_norm_rope, flash_attention) use the reference.

The whole-model decode path (DECODE_PATH, step.py) runs each decoder block as one launch
(layer.py, block.py) over a StaticKVCache written in place (cache.py), inside one compiled step.
Kernel objects are built lazily, once per (kernel, static shape class); model constants (norm eps,
RoPE base) are #defines; per-step values (the cache offset) are int32 arrays of 16 bytes; the cache
buffers are read and written through their strides. Without a GPU the same wrappers run through
the CPU emulator of tests/cuda_emu (`kernels.use_cuda_factory`).
"""

from .attention import decode_attention, unsupported_decode_attention  # noqa: F401
from .gemv import (  # noqa: F401
    gate_up_silu,
    linear,
    lm_head,
    qkv_proj,
    unsupported_gate_up_silu,
    unsupported_linear,
    unsupported_lm_head,
    unsupported_qkv_proj,
)
from .quantized_kv import quantized_attention, unsupported_quantized_attention  # noqa: F401
from .step import DECODE_PATH  # noqa: F401
