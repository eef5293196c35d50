"""Which is closer to the truth when stock and patched disagree: both against the same quantised
model evaluated in float32.

Half-precision models may legitimately give different greedy tokens once a kernel adds up in
another order or precision (stock's CUDA 4-bit GEMV accumulates in bf16, ours in fp32). The oracle
is a second copy of the model with every quantised layer dequantised exactly (scales and biases
in float32, w = scale*q + bias) and float32 activations. All three are fed the same tokens
(teacher forcing), so one early flip does not spoil the rest of the comparison.
"""

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import dequantize_model


def fp32_oracle(model):
    """Turn a fresh copy of a model (not the one under test) into its float32 oracle, in place."""
    model.set_dtype(mx.float32)  # scales and biases too, so dequantisation below is exact
    model = dequantize_model(model)
    mx.eval(model.parameters())
    return model


def forced_logits(model, prompt, tokens):
    """float32 logits after the prompt, then after each of tokens[..., :-1] (teacher forcing).

    prompt [L] with tokens [n] gives [n, vocab]; a batch, prompt [B, L] with tokens [B, n], gives
    [B, n, vocab]."""
    prompt, tokens = mx.array(prompt), mx.array(tokens).astype(mx.int32)
    single = prompt.ndim == 1
    if single:
        prompt, tokens = prompt[None], tokens[None]
    cache = make_prompt_cache(model)
    out = [model(prompt, cache=cache)[:, -1]]
    for i in range(tokens.shape[1] - 1):
        out.append(model(tokens[:, i:i + 1], cache=cache)[:, -1])
    out = mx.stack(out, 1).astype(mx.float32)
    return out[0] if single else out


def against(logits, oracle):
    """Distance of `logits` from the oracle's: max and median |difference|, top-1 agreement."""
    diff = mx.abs(logits - oracle)
    same = mx.argmax(logits, axis=-1) == mx.argmax(oracle, axis=-1)
    return {"max_abs": mx.max(diff).item(), "mean_abs": mx.mean(diff).item(),
            "top1_agree": mx.mean(same.astype(mx.float32)).item()}
