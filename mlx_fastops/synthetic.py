"""Synthetic models: real mlx-lm architectures with random weights, no download.

Random weights alone give near-flat logits, and greedy agreement on near-ties proves nothing. So
the output projection is scaled until the top-1/top-2 logit margin is clear (see `verify`), and
the residual branches are scaled so tokens vary instead of repeating the input.
"""

import contextlib
import json
import sys
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_map_with_path
from mlx_lm.utils import _get_classes, quantize_model, save_config, save_model

_QWEN3 = {"model_type": "qwen3", "rms_norm_eps": 1e-6, "max_position_embeddings": 40960,
          "rope_theta": 1000000.0, "head_dim": 128}
_QWEN2 = {"model_type": "qwen2", "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
          "rope_theta": 1000000.0}
_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

CONFIGS = {
    "qwen3-0.6b": {**_QWEN3, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "vocab_size": 151936,
                   "tie_word_embeddings": True},
    "qwen3-4b": {**_QWEN3, "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 151936,
                 "tie_word_embeddings": True},
    "qwen3-8b": {**_QWEN3, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 151936,
                 "tie_word_embeddings": False},
    "qwen3-14b": {**_QWEN3, "hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 40,
                  "num_attention_heads": 40, "num_key_value_heads": 8, "vocab_size": 151936,
                  "tie_word_embeddings": False},
    "llama-3.2-1b": {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192,
                     "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
                     "head_dim": 64, "rms_norm_eps": 1e-5, "vocab_size": 128256,
                     "max_position_embeddings": 131072, "rope_theta": 500000.0,
                     "rope_scaling": _LLAMA3_ROPE, "tie_word_embeddings": True},
    "llama-3.1-8b": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
                     "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                     "head_dim": 128, "rms_norm_eps": 1e-5, "vocab_size": 128256,
                     "max_position_embeddings": 131072, "rope_theta": 500000.0,
                     "rope_scaling": _LLAMA3_ROPE, "tie_word_embeddings": False},
    "qwen2.5-0.5b": {**_QWEN2, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                     "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
                     "tie_word_embeddings": True},
    "qwen2.5-3b": {**_QWEN2, "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
                   "num_attention_heads": 16, "num_key_value_heads": 2, "vocab_size": 151936,
                   "tie_word_embeddings": True},
    "qwen2.5-7b": {**_QWEN2, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                   "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
                   "tie_word_embeddings": False},
    # Qwen3-shaped, small enough for MLX's CPU backend (the default model of `bench` on CPU).
    "qwen3-cpu": {**_QWEN3, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 8,
                  "num_attention_heads": 16, "num_key_value_heads": 8, "vocab_size": 32768,
                  "tie_word_embeddings": True},
    # Test configs: every family, shapes that are not tile multiples, GQA 2 and 4, head counts
    # that split over 2 tensor-parallel ranks.
    "qwen3-tiny": {**_QWEN3, "hidden_size": 192, "intermediate_size": 320, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                   "vocab_size": 4096, "tie_word_embeddings": True},
    # Qwen3 with every projection's K in the tensor-core matmul's chunks (a multiple of 128): the
    # CUDA decode step's batched path (FastBlock.wide) on a tiny model.
    "qwen3-tiny-qmm": {**_QWEN3, "hidden_size": 256, "intermediate_size": 384, "num_hidden_layers": 2,
                       "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                       "vocab_size": 4096, "tie_word_embeddings": True},
    "llama-tiny": {"model_type": "llama", "hidden_size": 256, "intermediate_size": 448,
                   "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
                   "head_dim": 64, "rms_norm_eps": 1e-5, "vocab_size": 4096,
                   "max_position_embeddings": 131072, "rope_theta": 500000.0,
                   "rope_scaling": _LLAMA3_ROPE, "tie_word_embeddings": False},
    "qwen2-tiny": {**_QWEN2, "hidden_size": 256, "intermediate_size": 384, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 4096,
                   "max_position_embeddings": 4096, "tie_word_embeddings": True},
    # GQA 5 (Qwen3-14B's): odd G, one query head per CUDA attention block (Qwen2.5-0.5B's 7 too)
    "qwen2-tiny-g5": {**_QWEN2, "hidden_size": 320, "intermediate_size": 384, "num_hidden_layers": 2,
                      "num_attention_heads": 5, "num_key_value_heads": 1, "vocab_size": 4096,
                      "max_position_embeddings": 4096, "tie_word_embeddings": True},
}
# llama-tiny with K = 2304 (36 groups of 64): the tensor-core GEMV stages over 128 items a step of x,
# so its threads take a second item, and at 8 rows K is sliced (tests of cuda/gemv_mma.cu's staging).
CONFIGS["llama-tiny-wide"] = {**CONFIGS["llama-tiny"], "hidden_size": 2304}

# Residual-stream design (rms per element): the token embedding (1.0) and what attention adds (its
# output projection scaled by _ATTN_GAIN, about as large) both reach each layer's MLP, so the next
# token depends on the current one and on its context (a function of the current token alone falls
# into short cycles); the MLP branch (~sqrt(hidden)) dominates the embedding so much that, with tied
# embeddings, the current token's own logit is no larger than a random one's.
_EMBED_RMS = 1.0
_MLP_GAIN_PER_SQRT_HIDDEN = 10.0
_ATTN_GAIN = 3.0
# Target spread (std) of the logits: top-1/top-2 margins of a few units, not ~0.1.
_LOGIT_STD = 12.0


def synthetic_model(name, bits=4, group_size=64, seed=0, dtype=None, layers=None):
    """An mlx-lm model of architecture `name` (see CONFIGS) with random, peaked weights.

    bits: 4 or 8 (affine quantisation of every linear layer and the embedding), or None/0 for a
    float model. dtype: activations/scales dtype; bfloat16 by default, float32 for `*-cpu`/`*-tiny`.
    layers: number of decoder layers, if not the architecture's (real sizes, shorter models).
    Returns the model; its config dict (with "quantization" when quantised) is `model.fastops_config`.
    """
    if name not in CONFIGS:
        raise ValueError(f"unknown synthetic model {name!r}; choose from {sorted(CONFIGS)}")
    if bits not in (None, 0, 2, 3, 4, 5, 6, 8):
        raise ValueError(f"bits must be one of 2, 3, 4, 5, 6, 8 (fused: 4 and 8) or None for a float "
                         f"model, got {bits}")
    if bits and group_size not in (32, 64, 128):
        # mlx-lm would leave every layer whose size the group does not divide as it is: a float model
        raise ValueError(f"group_size must be 32, 64 or 128, got {group_size}")
    cfg = dict(CONFIGS[name])
    if layers is not None:
        if int(layers) < 1:
            raise ValueError(f"layers must be at least 1, got {layers}")
        cfg["num_hidden_layers"] = int(layers)
    if dtype is None:
        dtype = mx.float32 if name.endswith(("-cpu", "-tiny")) else mx.bfloat16
    mx.random.seed(seed)
    Model, Args = _get_classes(cfg)
    model = Model(Args.from_dict(cfg))
    _init_weights(model, seed)
    model.set_dtype(dtype)
    if bits:
        # mlx-lm prints "[INFO] Quantized model with ... bits per weight" on stdout, which holds the
        # CLI's tables: it goes to stderr.
        with contextlib.redirect_stdout(sys.stderr):
            model, cfg = quantize_model(model, cfg, group_size=group_size, bits=bits)
    cfg["torch_dtype"] = {mx.float32: "float32", mx.float16: "float16"}.get(dtype, "bfloat16")
    mx.eval(model.parameters())
    object.__setattr__(model, "fastops_config", cfg)
    object.__setattr__(model, "fastops_name", name)
    return model


def _init_weights(model, seed):
    key = mx.random.key(seed)
    hidden = model.args.hidden_size
    embed_gain = _EMBED_RMS * hidden**0.5  # nn.Embedding draws N(0, 1/hidden)
    tied = "lm_head" not in model
    head_rms = _EMBED_RMS if tied else (3 * hidden) ** -0.5  # nn.Linear: U(+-1/sqrt(hidden))

    def init(path, a):
        nonlocal key
        key, sub = mx.random.split(key)
        if path == "model.embed_tokens.weight":
            return a * embed_gain
        if path == "model.norm.weight":
            # logit std = gain * sqrt(hidden) * rms(head row)
            return mx.full(a.shape, _LOGIT_STD / (hidden**0.5 * head_rms))
        if path.endswith("norm.weight"):
            return 1.0 + 0.1 * mx.random.normal(a.shape, key=sub)
        if path.endswith("o_proj.weight"):
            return a * _ATTN_GAIN
        if path.endswith("down_proj.weight"):
            return a * (_MLP_GAIN_PER_SQRT_HIDDEN * hidden**0.5)
        if path.endswith(".bias"):
            return 0.1 * mx.random.normal(a.shape, key=sub)
        return a

    model.update(tree_map_with_path(init, model.parameters()))


def _synthetic_tokenizer(vocab_size):
    """Byte-level BPE without merges: any text encodes (one token per byte, ids 0-255); ids from
    256 up decode as "t<id>". Byte-level because transformers builds its own Qwen2Tokenizer for
    qwen2 configs from vocab and merges, ignoring other tokenizer.json models."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = sorted(byte_chars, key=lambda c: (len(c.encode()), c))[:256]
    vocab = {c: i for i, c in enumerate(byte_chars)}
    vocab.update({f"t{i}": i for i in range(len(vocab), vocab_size)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    names = list(vocab)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=names[1], bos_token=names[2],
                                   unk_token=names[0])


def save_synthetic(name, path, bits=4, group_size=64, seed=0, dtype=None):
    """Write `name` as a local mlx-lm model directory (weights, config, a synthetic tokenizer).

    `mlx_lm.load(path)` / `mlx_lm.generate --model path` then work offline.
    """
    model = synthetic_model(name, bits=bits, group_size=group_size, seed=seed, dtype=dtype)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_model(path, model)
    cfg = dict(model.fastops_config)
    save_config(cfg, path / "config.json")
    _synthetic_tokenizer(cfg["vocab_size"]).save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))
    return path
