"""Run-time switches read from the environment.

MLX_FASTOPS_DISABLE   comma-separated fusion/kernel names to leave stock (see FUSIONS)
MLX_FASTOPS_BACKEND   auto (default) | reference | metal | cuda
MLX_FASTOPS_RECIPES   directories (os.pathsep-separated) of more model-family recipes,
                      <family>.json each, besides the package's patches/ (see families.py)
MLX_FASTOPS_TUNE      patch()'s default `tune`: auto (default) | on | off | force (see tuner.py)
MLX_FASTOPS_TUNE_CACHE  the folder of the tuner's decisions (default: $XDG_CACHE_HOME/mlx_fastops,
                      else ~/.cache/mlx_fastops; see tune_cache.py)
"""

import os

import mlx.core as mx

# Every name a user may pass to MLX_FASTOPS_DISABLE or patch(disable=...): one per fusion, the
# prefill path of the GPU projections, then the whole-path switches of the CUDA decode path.
FUSIONS = {
    "qkv": "Q/K/V projections as one matmul on concatenated weights (GPU: one GEMV kernel for decode)",
    "gate_up": "gate/up projections as one matmul, then SiLU(gate)*up (GPU: one GEMV kernel for decode)",
    "qk_norm_rope": "per-head q/k RMSNorm and RoPE in one op",
    "residual_norm": "residual add + post-attention RMSNorm in one op",
    "lm_head": "the (tied or untied) output projection",
    "attention": "decode attention and prefill attention ops",
    "prefill": "GPU: QKV, gate/up, o_proj, down and lm_head calls of more than 8 rows on the backend's "
               "prefill path (CUDA: 9-64 rows a quantised matmul on tensor cores, 512 rows or more dense "
               "matmuls on weights dequantised per call, but lm_head's); off: stock quantized_matmul",
    "fast_decode": "CUDA: each decoder block as one launch (norm + QKV + q/k norm + RoPE + cache write, "
                   "attention, o_proj + residual, norm + gate/up + SiLU, down + residual) over a static KV "
                   "cache; consecutive small layers share a launch, large ones in one-row steps",
    "compile": "CUDA: the whole decode step (embedding, fast_decode launches, final norm) as one "
               "mx.compile'd function",
}

BACKENDS = ("auto", "reference", "metal", "cuda")
TUNE_MODES = ("auto", "on", "off", "force")


def parse_names(names, source):
    """Split and validate fusion names; raises ValueError naming the bad ones."""
    if isinstance(names, str):
        names = [n for n in names.replace(" ", "").split(",") if n]
    names = set(names)
    unknown = sorted(names - FUSIONS.keys())
    if unknown:
        raise ValueError(
            f"{source}: unknown fusion name(s) {unknown}; valid names are {sorted(FUSIONS)}"
        )
    return names


def disabled(extra=()):
    """Fusions switched off by MLX_FASTOPS_DISABLE and `extra` (patch(disable=...))."""
    env = parse_names(os.environ.get("MLX_FASTOPS_DISABLE", ""), "MLX_FASTOPS_DISABLE")
    return env | parse_names(extra, "disable")


def backend_name():
    """The kernel backend to use: MLX_FASTOPS_BACKEND, or the best one this machine has."""
    name = os.environ.get("MLX_FASTOPS_BACKEND", "auto").strip().lower() or "auto"
    if name not in BACKENDS:
        raise ValueError(f"MLX_FASTOPS_BACKEND={name!r}; expected one of {BACKENDS}")
    if name == "auto":
        if mx.metal.is_available():
            return "metal"
        if mx.cuda.is_available():
            return "cuda"
        return "reference"
    if name in ("metal", "cuda") and not getattr(mx, name).is_available():
        from . import kernels
        if not kernels.factory_replaced(name):
            raise ValueError(f"MLX_FASTOPS_BACKEND={name}, but MLX sees no {name} device here "
                             f"(mx.{name}.is_available() is False); use auto or reference")
    return name


def tune_mode(tune=None):
    """patch()'s `tune` as one of TUNE_MODES: None reads MLX_FASTOPS_TUNE (default auto); True is
    on, False off (patch() takes a tuner.Tuner itself, before this). Raises ValueError / TypeError."""
    if tune is None:
        tune = os.environ.get("MLX_FASTOPS_TUNE", "auto").strip().lower() or "auto"
        source = "MLX_FASTOPS_TUNE"
    else:
        source = "tune"
    if isinstance(tune, bool):
        return "on" if tune else "off"
    if not isinstance(tune, str):
        raise TypeError(f"{source} must be one of {TUNE_MODES}, True/False or a mlx_fastops.Tuner, "
                        f"got {type(tune).__name__}")
    if tune not in TUNE_MODES:
        raise ValueError(f"{source}={tune!r}; expected one of {TUNE_MODES}")
    return tune
