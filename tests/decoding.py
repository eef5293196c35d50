"""Greedy decoding shared by the whole-model tests (tests/ is on sys.path through conftest.py)."""

import mlx.core as mx
from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache


def greedy(model, prompt, n, kv_bits=None, max_kv_size=None):
    """Greedy decode of a [B, L] prompt; returns (tokens [B, n] as lists, last logits).

    kv_bits converts the cache to mlx-lm's QuantizedKVCache after the prompt; max_kv_size makes
    RotatingKVCaches."""
    cache = make_prompt_cache(model, max_kv_size=max_kv_size)
    logits = model(prompt, cache=cache)
    if kv_bits:
        cache = [c.to_quantized(group_size=64, bits=kv_bits) for c in cache]
        assert isinstance(cache[0], QuantizedKVCache)
    out = []
    for _ in range(n):
        tok = mx.argmax(logits[:, -1, :], axis=-1)
        out.append(tok)
        logits = model(tok[:, None], cache=cache)
    return mx.stack(out, axis=1).tolist(), logits


def prompt_of(model, batch, length, seed=0):
    return mx.random.randint(0, model.args.vocab_size, (batch, length), key=mx.random.key(seed))
