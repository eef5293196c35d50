"""Generation with mlx-lm's quantised KV cache (`kv_bits`) on a model patched for CUDA: through
mlx_lm.generate.generate_step itself, which converts the cache (maybe_quantize_kv_cache) once it
holds quantized_kv_start positions, into StaticQuantizedKVCaches. From then on calls of up to 8
rows run the one-launch layers (the QKV epilogue quantising each new k/v row into the cache, the
attention phase reading it packed); longer prompt chunks, and everything with fast_decode off, the
composed ops with the CUDA quantized_attention op.

Stock mlx-lm cannot run this on a CUDA device (mx.quantized_matmul has no kernel there for these
shapes at 8 bits), so stock and the float32 oracle (the same quantised model in float32, with a
cache quantised the same way from its own float32 K/V) run on the CPU; the patched model runs on
the CUDA backend (the GPU, or the CPU emulator tests/cuda_emu). All three are teacher-forced along
stock's greedy tokens, and judged by the half-precision standard (mlx_fastops.fidelity.judge).
"""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

import mlx_fastops
from mlx_fastops import fidelity, synthetic_model
from mlx_fastops.backends.cuda import quantized_kv
from mlx_fastops.backends.cuda.cache import StaticQuantizedKVCache

pytestmark = [pytest.mark.cuda]

PROMPT, GEN = 40, 16
CASES = [  # kv_bits, kv group size, quantized_kv_start, prefill step, fusions off, query rows of the
    # composed decode kernel's calls (quantized_kv._decode)
    # converted after the first 16-token chunk: the prompt's next chunks over the quantised cache
    # (16 tokens: dequantised + SDPA; the last 7: the one-launch layers), then every decode step
    (8, 64, 0, 16, (), set()),
    (4, 32, PROMPT + 4, 2048, (), set()),   # a few fast-path steps on the StaticKVCache first, then converted
    # the composed ops: the last 7 prompt tokens and every decode step through the decode kernel
    (8, 64, 0, 16, ("fast_decode",), {1, 7}),
]


def generate(model, prompt, bits, group, start, chunk, tokens=None, stream=None):
    """(tokens, log-probs [GEN, vocab], cache) of generate_step; with `tokens`, teacher-forced
    along them (the sampler returns them in turn)."""
    forced = iter([*tokens, 0]) if tokens is not None else None   # generate_step samples once more
    sampler = None if forced is None else (lambda logprobs: mx.array([next(forced)]))
    cache = make_prompt_cache(model)
    steps = generate_step(prompt, model, max_tokens=GEN, sampler=sampler, prompt_cache=cache,
                          prefill_step_size=chunk, kv_bits=bits, kv_group_size=group, quantized_kv_start=start,
                          **({"stream": stream} if stream is not None else {}))
    out, logprobs = zip(*steps)
    return list(out), mx.stack(logprobs), cache


@pytest.mark.parametrize("backend", ["cuda"], indirect=True)
@pytest.mark.parametrize("bits,group,start,chunk,off,rows", CASES)
def test_generate_with_quantized_kv_cache(backend, bits, group, start, chunk, off, rows, monkeypatch):
    monkeypatch.setenv("MLX_FASTOPS_BACKEND", "cuda")
    model = synthetic_model("qwen3-tiny", bits=4, dtype=mx.bfloat16, seed=6)
    prompt = mx.random.randint(0, model.args.vocab_size, (PROMPT,), key=mx.random.key(6))
    tokens, stock, stock_cache = generate(model, prompt, bits, group, start, chunk, stream=mx.cpu)
    oracle = fidelity.fp32_oracle(synthetic_model("qwen3-tiny", bits=4, dtype=mx.bfloat16, seed=6))
    _, exact, oracle_cache = generate(oracle, prompt, bits, group, start, chunk, tokens, stream=mx.cpu)

    decodes = []
    real_decode = quantized_kv._decode
    monkeypatch.setattr(quantized_kv, "_decode", lambda *a: decodes.append(a[0].shape[2]) or real_decode(*a))
    # The emulator runs outside MLX's graph: no mx.compile'd step there (docs/cuda-emulator.md).
    report = mlx_fastops.patch(model, disable=off + (() if mx.cuda.is_available() else ("compile",)))
    try:
        fast = not off
        assert any(e.fusion == "fast_decode" and e.status == ("fused" if fast else "skipped")
                   for e in report.entries), str(report)
        _, patched, cache = generate(model, prompt, bits, group, start, chunk, tokens)
    finally:
        mlx_fastops.unpatch(model)

    assert all(isinstance(c, QuantizedKVCache) and c.bits == bits for c in cache)
    assert all(type(c) is (StaticQuantizedKVCache if fast else QuantizedKVCache) for c in cache)
    assert set(decodes) == rows
    if fast:   # the one-launch layers wrote the last rows (their attention output is the last reader)
        assert all(c.last_reader is not None for c in cache)
    else:   # every L=1 call after the conversion (generate_step's first is the prompt's last token)
        assert decodes.count(1) == (PROMPT + GEN - max(PROMPT - 1, start)) * len(cache)
    # The converted caches' contents, dequantised: patched no further from the oracle's than stock's
    # (a row missing from the conversion would be far off).
    def dequantized(c, i):   # keys (0) or values (1) of a converted cache, float32
        return mx.dequantize(*(x[..., :c.offset, :] for x in (c.keys, c.values)[i]),
                             group_size=group, bits=bits).astype(mx.float32)

    for c, s, o in zip(cache, stock_cache, oracle_cache):
        assert c.offset == s.offset == o.offset == PROMPT + GEN
        for i in range(2):
            truth = dequantized(o, i)
            assert mx.linalg.norm(dequantized(c, i) - truth).item() <= 1.1 * mx.linalg.norm(dequantized(s, i) - truth).item()
    verdict = fidelity.judge(stock, patched, exact)
    print(f"kv_bits={bits} group={group} start={start}: stock {verdict['stock']}, patched {verdict['patched']}")
    assert not verdict["problems"], verdict["problems"]


def _rel(a, b):
    a, b = (np.asarray(t.astype(mx.float32)).astype(np.float64) for t in (a, b))
    assert np.isfinite(a).all(), "non-finite output"
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("name,B,L,bits,group", [("qwen3-tiny", 1, 1, 8, 64), ("llama-tiny", 1, 3, 4, 32),
                                                 ("qwen3-tiny", 2, 1, 4, 64), ("llama-tiny", 2, 4, 8, 32)])
def test_one_launch_layer_over_a_quantized_cache(name, B, L, bits, group, on_gpu, monkeypatch):
    """One layer's launch (fb.core) over a quantised cache of P positions: the new k/v rows it packs
    are the rows the same launch writes into a float cache, quantised as mx.quantize does on CUDA
    (quantize_as_cuda), bit for bit; the other positions untouched; its output no further from the
    block evaluated in float32 over mlx-lm's QuantizedKVCache holding the same positions (which
    quantises the new rows with mx.quantize) than the stock bf16 block over it. Again with
    attention blocks of another number of query heads (all G, or 1 where the default takes all):
    bit for bit; so is the launch with phase stamps, whose blocks that mark (quantized_attention.cu's
    included) mark in order between their entry and end. llama-tiny's QKV phase runs on tensor cores
    (gemv_mma.cu), as in a large layer."""
    from test_cuda_head import quantize_as_cuda

    from mlx_fastops import kernels
    from mlx_fastops.backends.cuda import block, gemv, layer
    from mlx_fastops.backends.cuda.source import offset_array

    monkeypatch.setenv("MLX_FASTOPS_BACKEND", "cuda")
    if name == "llama-tiny":   # a layer of its own, as a large one
        monkeypatch.setattr(block, "GROUP_MAX_WEIGHTS", 0)
        kernels.clear_builders()
    model = synthetic_model(name, bits=4, dtype=mx.bfloat16, seed=3)
    stock = model.model.layers[0]
    mlx_fastops.patch(model, disable=("compile",))
    try:
        fb = model.model.layers[0].fast_fn
        P, S = 70, 128
        rows = [mx.random.normal((B, fb.HKV, S, fb.D)).astype(mx.bfloat16) for _ in range(2)]
        quantized = [mx.quantize(r, group_size=group, bits=bits) for r in rows]
        x = mx.random.normal((B, L, model.args.hidden_size)).astype(mx.bfloat16)

        def run_quantized(stamps=False):
            bufs = [a + 0 for t in quantized for a in t]
            mx.eval(bufs)
            if stamps:
                out, o, st, groups = layer.layers_launch([fb], x, offset_array(P), [(*bufs, bufs[1])], stamps=True)
                mx.eval(out, o, st)
                return out, bufs, np.asarray(st), groups
            out, o = fb.core(x, offset_array(P), *bufs, bufs[1])
            mx.eval(out, o)
            return out, bufs

        out_q, bufs = run_quantized()
        *stamped, st, groups = run_quantized(stamps=True)
        G_ = fb.H // fb.HKV
        fb.gb, gb = (G_ if G_ != fb.gb else 1), fb.gb
        variant = run_quantized()
        fb.gb = gb
        kc, vc = (mx.dequantize(*t, group_size=group, bits=bits) for t in quantized)
        mx.eval(fb.core(x, offset_array(P), kc, vc, kc))   # the new rows, unquantised, into kc / vc
        qkv = fb.qkv
        assert gemv.mma_takes(mx.bfloat16, B * L, qkv.in_features, qkv.out_features, 4, 64, 3, False, True, fb.D,
                              not fb.grouped) == (name == "llama-tiny")
    finally:
        mlx_fastops.unpatch(model)
        kernels.clear_builders()   # no kernel built under the forced rule outlives the test
    for run in (variant, stamped):
        for a, b in zip((out_q, *bufs), (run[0], *run[1])):
            assert mx.array_equal(a, b)
    from cuda_checks import assert_marks_in_order
    attn = st[groups[0]:groups[0] + groups[1], 3:]
    assert (attn != 0).all(axis=1).any() and ((attn != 0).all(axis=1) | (attn == 0).all(axis=1)).all(), \
        "attention blocks marked partly or none"
    assert_marks_in_order(st)
    for i, new in enumerate((kc, vc)):
        want = quantize_as_cuda(new[:, :, P:P + L], group, bits)
        for got, w, old in zip(bufs[3 * i:3 * i + 3], want, quantized[i]):
            g = np.asarray(got.astype(mx.uint32 if got.dtype == mx.uint32 else mx.float32))
            assert np.array_equal(g[:, :, P:P + L], w), i
            assert mx.array_equal(got[:, :, :P], old[:, :, :P]) and mx.array_equal(got[:, :, P + L:], old[:, :, P + L:])
    oracle = fidelity.fp32_oracle(synthetic_model(name, bits=4, dtype=mx.bfloat16, seed=3)).model.layers[0]
    ref = []
    for blk, dt in ((oracle, mx.float32), (stock, mx.bfloat16)):
        cache = QuantizedKVCache(group_size=group, bits=bits)
        cache.keys, cache.values = (tuple(a[:, :, :P].astype(mx.uint32 if a.dtype == mx.uint32 else dt) for a in t)
                                    for t in quantized)
        cache.offset = P
        with mx.stream(mx.cpu):   # stock's quantised attention has no CUDA kernel for these shapes
            ref.append(blk(x.astype(dt), mask="causal" if L > 1 else None, cache=cache))
            mx.eval(ref[-1])
    print(f"{name} B={B} L={L} kv_bits={bits}: vs float32 patched {_rel(out_q, ref[0]):.2e}, stock {_rel(ref[1], ref[0]):.2e}")
    assert _rel(out_q, ref[0]) <= max(1.1 * _rel(ref[1], ref[0]), 1e-2)


@pytest.mark.parametrize("backend", ["cuda"], indirect=True)
def test_trimmed_quantized_cache_decodes_as_a_fresh_one(backend, monkeypatch):
    """Speculative decoding's rejection: steps over the converted cache, trim(2), two other tokens:
    the same logits, bit for bit, as a cache that never held the rejected two (the fast path
    attends up to its offset and overwrites the stale rows)."""
    monkeypatch.setenv("MLX_FASTOPS_BACKEND", "cuda")
    model = synthetic_model("qwen3-tiny", bits=4, dtype=mx.bfloat16, seed=7)
    prompt = mx.random.randint(0, model.args.vocab_size, (1, 20), key=mx.random.key(7))
    steps = [[5], [9], [11], [13]]
    mlx_fastops.patch(model, disable=() if mx.cuda.is_available() else ("compile",))
    try:
        def run(tokens, trim_after=None):
            cache = make_prompt_cache(model)
            model(prompt, cache=cache)
            cache = [c.to_quantized(group_size=64, bits=8) for c in cache]
            assert all(type(c) is StaticQuantizedKVCache for c in cache)
            out = []
            for i, t in enumerate(tokens):
                out.append(model(mx.array([t]), cache=cache)[0, -1])
                mx.eval(out[-1])
                if i == trim_after:
                    assert all(c.trim(2) == 2 for c in cache)
                    out = out[:-2]
            assert all(c.last_reader is not None for c in cache)   # the fast path wrote the last rows
            return out

        trimmed = run(steps + [[17], [19]], trim_after=3)
        fresh = run(steps[:2] + [[17], [19]])
    finally:
        mlx_fastops.unpatch(model)
    assert len(trimmed) == len(fresh) == 4
    for a, b in zip(trimmed, fresh):
        assert mx.array_equal(a, b)
