"""Resolving --model: a synthetic name, a local mlx-lm directory, or a Hugging Face repo."""

from pathlib import Path

import mlx.core as mx

from .synthetic import CONFIGS, synthetic_model

# MLX's CPU backend is slow with half precision (synthetic Qwen3-0.6B 4-bit: 0.19 tok/s with bf16
# activations, 1.75 tok/s with fp32, 2 cores), so without a GPU the default is a smaller,
# Qwen3-shaped fp32 model.
GPU_DEFAULT = ("qwen3-0.6b", "Qwen3-0.6B architecture, 4-bit g64, bf16")
CPU_DEFAULT = ("qwen3-cpu", "no GPU: Qwen3-shaped (hidden 1024, 8 layers, vocab 32k), 4-bit g64, fp32 "
                            "activations, because MLX's CPU backend is slow with half precision")


def on_gpu():
    return mx.metal.is_available() or mx.cuda.is_available()


def default_model():
    return GPU_DEFAULT if on_gpu() else CPU_DEFAULT


def load(spec=None, bits=4, group_size=64, seed=0):
    """Returns (model, tokenizer or None, label, note)."""
    note = ""
    if spec is None:
        spec, note = default_model()
    if spec in CONFIGS:
        model = synthetic_model(spec, bits=bits, group_size=group_size, seed=seed)
        quant = f"{bits}-bit g{group_size}" if bits else "float"
        return model, None, f"{spec} (synthetic, {quant})", note
    import mlx_lm

    if not Path(spec).exists() and "/" not in spec:
        raise ValueError(f"--model {spec!r} is neither a synthetic model ({sorted(CONFIGS)}), "
                         "a local directory, nor a Hugging Face repo (owner/name)")
    model, tokenizer = mlx_lm.load(spec)
    return model, tokenizer, spec, note


def quant_label(model):
    """'4-bit g64', '8-bit g32', 'float' from the first decoder layer's q projection."""
    q = model.layers[0].self_attn.q_proj
    if hasattr(q, "bits"):
        return f"{q.bits}-bit g{q.group_size}" + ("" if q.mode == "affine" else f" {q.mode}")
    return str(q.weight.dtype).replace("mlx.core.", "")
