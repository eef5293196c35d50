"""mlx_fastops: fused kernels that make mlx-lm decode and prefill faster, with identical outputs.

    import mlx_lm, mlx_fastops
    model, tokenizer = mlx_lm.load("mlx-community/Qwen3-0.6B-4bit")
    print(mlx_fastops.patch(model))
    mlx_fastops.unpatch(model)
"""

from .config import FUSIONS
from .patcher import PatchReport, is_patched, patch, unpatch
from .synthetic import save_synthetic, synthetic_model
from .tuner import Tuner

__version__ = "0.1.0"
__all__ = ["patch", "unpatch", "is_patched", "PatchReport", "synthetic_model", "save_synthetic", "Tuner",
           "FUSIONS", "__version__"]
