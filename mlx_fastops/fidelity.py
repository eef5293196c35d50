"""Which is closer to the truth when stock and patched disagree: both against the same quantised
model evaluated in float32.

Half-precision models may legitimately give different greedy tokens once a kernel adds up in
another order or precision (stock's CUDA 4-bit GEMV accumulates in bf16, ours in fp32). The oracle
is a second copy of the model with every quantised layer dequantised exactly (scales and biases
in float32, w = scale*q + bias) and float32 activations. All three are fed the same tokens
(teacher forcing), so one early flip does not spoil the rest of the comparison.

`judge` applies the half-precision standard (DESIGN.md): patched no further from the oracle than
stock, and the same top-1 as stock wherever stock's top-1/top-2 margin is clear.
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
    """Distance of `logits` from the oracle's: max and mean |difference|, top-1 agreement."""
    diff = mx.abs(logits - oracle)
    same = mx.argmax(logits, axis=-1) == mx.argmax(oracle, axis=-1)
    return {"max_abs": mx.max(diff).item(), "mean_abs": mx.mean(diff).item(),
            "top1_agree": mx.mean(same.astype(mx.float32)).item()}


def judge(stock, patched, oracle):
    """The half-precision standard on teacher-forced logits [..., vocab] of stock, patched and the
    float32 oracle. A step's decision is clear where stock's top-1/top-2 margin exceeds twice stock's
    largest logit error against the oracle there: then the float32 model itself ranks stock's token
    first, whatever the rounding, so patched must pick it too; below that it is a near-tie, which
    either half-precision path may flip. Returns stock's and patched's `against` figures; per step
    stock's margin and largest error; the number of clear steps and those (flat indices) where
    patched picks another token; `problems`, one line per way the standard fails (none: it holds):
    patched not finite, further from the oracle than stock (mean |logit difference|), or changing
    a clear decision."""
    vocab = stock.shape[-1]
    stock, patched, oracle = (a.astype(mx.float32).reshape(-1, vocab) for a in (stock, patched, oracle))
    top2 = mx.topk(stock, 2, axis=-1)
    margin = mx.max(top2, axis=-1) - mx.min(top2, axis=-1)
    error = mx.max(mx.abs(stock - oracle), axis=-1)
    clear = margin > 2 * error
    changed = clear & (mx.argmax(patched, axis=-1) != mx.argmax(stock, axis=-1))
    changed = [i for i, c in enumerate(changed.tolist()) if c]
    s, p = against(stock, oracle), against(patched, oracle)
    problems = []
    if not mx.all(mx.isfinite(patched)).item():
        problems.append("patched logits are not finite")
    if not p["mean_abs"] <= s["mean_abs"]:
        problems.append(f"patched is further from float32 than stock (mean |logit diff| {p['mean_abs']:.4f} > "
                        f"{s['mean_abs']:.4f})")
    if changed:
        problems.append(f"patched picks another token than stock at {len(changed)} clear decision(s) (steps "
                        f"{', '.join(map(str, changed[:8]))}{', ...' if len(changed) > 8 else ''})")
    return {"stock": s, "patched": p, "margin": margin.tolist(), "error": error.tolist(),
            "clear": mx.sum(clear).item(), "changed": changed, "problems": problems}
