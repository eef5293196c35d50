"""Metal backend: mx.fast.metal_kernel wrappers around metal/*.metal, one kernel family a module.

Each op function has the reference signature (mlx_fastops.backends.reference); an optional
`unsupported_<op>(**info)` returns why a static shape class must fall back to the reference.
"""

from .attention import (  # noqa: F401
    decode_attention,
    flash_attention,
    unsupported_decode_attention,
    unsupported_flash_attention,
)
from .attention import flash_attention_q8 as quantized_attention  # noqa: F401
from .attention import unsupported_flash_attention_q8 as unsupported_quantized_attention  # noqa: F401
from .gemv import (  # noqa: F401
    gate_up_silu,
    lm_head,
    qkv_proj,
    unsupported_gate_up_silu,
    unsupported_lm_head,
    unsupported_qkv_proj,
)
from .norm_rope import (  # noqa: F401
    qk_norm_rope,
    rms_norm_residual,
    unsupported_qk_norm_rope,
    unsupported_rms_norm_residual,
)

DECODE_PATH = None   # no whole-model decode path (mlx_fastops.backends.DecodePath)
