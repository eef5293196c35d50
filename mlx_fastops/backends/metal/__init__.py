"""Metal backend: mx.fast.metal_kernel wrappers around metal/*.metal, one kernel family a module.

Each op function has the reference signature (mlx_fastops.backends.reference); an optional
`unsupported_<op>(**info)` returns why a static shape class must fall back to the reference.
"""

from .gemv import gate_up_silu, lm_head, qkv_proj  # noqa: E402,F401
from .gemv import unsupported_gate_up_silu, unsupported_lm_head, unsupported_qkv_proj  # noqa: E402,F401
from .attention import decode_attention, flash_attention  # noqa: E402,F401
from .attention import unsupported_decode_attention, unsupported_flash_attention  # noqa: E402,F401
from .norm_rope import qk_norm_rope, rms_norm_residual  # noqa: E402,F401
from .norm_rope import unsupported_qk_norm_rope, unsupported_rms_norm_residual  # noqa: E402,F401
from .attention import flash_attention_q8 as quantized_attention  # noqa: E402,F401
from .attention import unsupported_flash_attention_q8 as unsupported_quantized_attention  # noqa: E402,F401
