"""Run-time switches read from the environment.

MLX_FASTOPS_DISABLE   comma-separated fusion/kernel names to leave stock (see FUSIONS)
MLX_FASTOPS_BACKEND   auto (default) | reference | metal | cuda
"""

import contextlib
import contextvars
import os

import mlx.core as mx

# Every name a user may pass to MLX_FASTOPS_DISABLE or patch(disable=...). Model-level fusions
# first, then the kernel-level switches the GPU backends consult.
FUSIONS = {
    "qkv": "Q/K/V projections as one matmul on concatenated weights",
    "gate_up": "gate/up projections as one matmul, then SiLU(gate)*up",
    "qk_norm_rope": "per-head q/k RMSNorm and RoPE in one op",
    "residual_norm": "residual add + post-attention RMSNorm in one op",
    "lm_head": "the (tied or untied) output projection",
    "attention": "decode attention and prefill attention ops",
    "fast_decode": "CUDA: whole decoder block in one launch (layer_kernel) or 5 (norm+QKV+qk-norm+RoPE+"
                   "cache write, attention, o_proj+residual, norm+gate/up+SiLU, down+residual) with a "
                   "static KV cache",
    "layer_kernel": "CUDA: each fast_decode block as one launch (its 5 kernels as 5 block groups, "
                    "each waiting for the previous); off: 5 launches",
    "compile": "CUDA: mx.compile of the whole decode step (fast_decode blocks)",
    "layer_groups": "CUDA compiled decode step: consecutive one-launch layers (up to 64M weights each) "
                    "share one launch (fewer kernel nodes per step; without layer_loop at most 4)",
    "layer_loop": "CUDA one-launch layers: a launch of several layers has one call site per phase, each "
                  "block picking its layer's inputs at run time (the same code, and the same float "
                  "arithmetic, for any number of layers; else the compiler copies the phases per layer)",
    "layer_prefetch": "CUDA one-launch layer: each GEMV phase starts its weights (first step into "
                      "registers, its rows into L2) before it waits for the previous phase",
    "layer_wait_load": "CUDA one-launch layer: blocks poll the previous phase's counter with loads "
                       "(off: atomic read-modify-writes, which queue with that phase's arrivals)",
    "layer_one_wave": "CUDA one-launch layer: a GEMV phase with long rows (K >= 2048) takes 2 or 4 rows per "
                      "warp where fewer would leave a second wave of blocks (Qwen3-4B o_proj, down, QKV; 8B QKV)",
    "layer_stream": "CUDA one-launch layer: a GEMV phase of more row groups than one wave of blocks "
                    "holds (gate/up) launches one wave, each block running several groups in turn with "
                    "the next group's rows sent to L2 ahead (one prologue per block)",
    "attn_prefetch": "CUDA one-launch layer: attention blocks send their chunk's cached K/V rows to L2 "
                     "before they wait for the QKV phase (the rows do not depend on it)",
    "attn_head_split": "CUDA one-launch layer: attention blocks take at most 2 of a kv head's query heads "
                       "(fewer registers; the K/V chunk is read once per pair of heads)",
    "x_stage": "CUDA GEMVs (half types, rows x in_features <= 4096): each block converts x to float (with "
               "a folded input RMSNorm: normalizes it) once, into shared memory; off: every warp converts "
               "its lanes' slices at every k-step",
    "nibble_fold": "CUDA GEMVs: a 4-bit weight becomes a float by one byte permute (0.5 + q/32, the offset "
                   "taken out with the x-sum); off: 2^23 + q, then a subtraction",
    "qkv_kernel": "GPU kernel of the fused Q/K/V op (off: stacked weights + one stock quantized_matmul)",
    "gate_up_kernel": "GPU kernel of the fused gate/up+SiLU op (off: one stock quantized_matmul + swiglu)",
    "lm_head_kernel": "GPU kernel of the lm_head op (off: the stock quantized_matmul)",
}

BACKENDS = ("auto", "reference", "metal", "cuda")


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


_patch_disabled = contextvars.ContextVar("mlx_fastops_patch_disabled", default=frozenset())


def disabled(extra=()):
    """Fusions switched off by MLX_FASTOPS_DISABLE, by the running patch(disable=...), and `extra`."""
    env = parse_names(os.environ.get("MLX_FASTOPS_DISABLE", ""), "MLX_FASTOPS_DISABLE")
    return env | _patch_disabled.get() | parse_names(extra, "disable")


@contextlib.contextmanager
def disabling(names):
    """While patch() runs, backends' support checks see its `disable` names through `disabled()`."""
    token = _patch_disabled.set(frozenset(names))
    try:
        yield
    finally:
        _patch_disabled.reset(token)


def switched_off(name):
    """A backend's reason for falling back when kernel switch `name` is off, else None."""
    return f"disabled ({name})" if name in disabled() else None


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
