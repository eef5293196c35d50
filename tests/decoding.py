"""Greedy decoding shared by the whole-model tests (tests/ is on sys.path through conftest.py)."""

import mlx.core as mx
import numpy as np
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


def batch_generator_run(model, prompts, max_tokens, join_at, forced=None):
    """Greedy decoding through mlx-lm's BatchGenerator, as mlx_lm.server and batch_generate run it:
    prompts[i] (a token list) joins the running batch before generation step join_at[i] (0: at the
    start; prefill, then extend), and finishes after max_tokens[i] tokens (the batch filters it out).

    Returns (tokens, logits): per prompt, its generated tokens and the float32 logits [n, vocab]
    that chose them. forced (a previous run's tokens): each row takes those tokens instead of its
    own argmax (teacher forcing, so two models' logits are compared along one path)."""
    from mlx_lm.generate import BatchGenerator

    logits = [[] for _ in prompts]

    def processor(i):
        def record(_context, row_logits):
            row = row_logits.astype(mx.float32)
            mx.eval(row)
            logits[i].append(np.asarray(row)[0])
            n = len(logits[i])
            if forced is None or n > len(forced[i]):   # (the batch samples one token past the end)
                return row_logits
            # the forced token and nothing else: the greedy sampler must pick it
            return mx.where(mx.arange(row_logits.shape[-1]) == forced[i][n - 1], 0.0, -mx.inf)[None]
        return record

    gen = BatchGenerator(model, completion_batch_size=64, prefill_batch_size=64)
    uid_of, tokens = {}, [[] for _ in prompts]
    step = 0
    while step == 0 or any(len(t) < m for t, m in zip(tokens, max_tokens)):
        joining = [i for i, s in enumerate(join_at) if s == step]
        if joining:
            uids = gen.insert([prompts[i] for i in joining], max_tokens=[max_tokens[i] for i in joining],
                              logits_processors=[[processor(i)] for i in joining])
            uid_of.update(zip(uids, joining))
        for r in gen.next_generated():
            tokens[uid_of[r.uid]].append(r.token)
        step += 1
    gen.close()
    return tokens, [np.stack(rows[:len(t)]) for rows, t in zip(logits, tokens)]
