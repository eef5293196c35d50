"""Decoding with the CUDA backend (patched) vs stock mlx-lm on synthetic models. Skipped without CUDA.

Stock and patched runs use the same model object (patch, then unpatch). Exact token equality with
stock is not the criterion for bf16 models: stock's CUDA 4-bit GEMV adds up in bf16, ours in fp32,
and on the tiny models stock's own logits are ~0.1-0.5 (mean) and up to ~3 (max) away from a float32
evaluation of the same quantised model, so near-ties flip either way. The judge is that float32
oracle (mlx_fastops.fidelity): stock, patched and the oracle are fed stock's greedy tokens (teacher
forcing), and patched must be no further from the oracle than stock, and pick the oracle's token at
every step where stock picks it with a clear margin.
"""

import mlx.core as mx
import numpy as np
import pytest

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend")]

from mlx_lm.models.cache import make_prompt_cache

import mlx_fastops
from mlx_fastops import fidelity, synthetic_model

GEN = 40
CLEAR = 0.5          # oracle top-1/top-2 margin (logits) that counts as a clear decision
MIN_COMPARED = 20    # clear steps per row, at least
# Real-size models' bf16 logits reach 20-30, where one bf16 step is 0.125-0.25: argmax is compared
# only where stock's top-1/top-2 margin is at least this (the logits themselves within 5%).
REAL_MARGIN = 1.0


def greedy(model, prompt, n):
    """Greedy tokens [B, n] of a [B, L] prompt and stock's top-1/top-2 margins [B, n]."""
    cache = make_prompt_cache(model)
    logits = model(prompt, cache=cache)[:, -1, :]
    toks, margins = [], []
    for _ in range(n):
        lf = logits.astype(mx.float32)
        top2 = mx.topk(lf, 2, axis=-1)
        tok = mx.argmax(lf, axis=-1)
        mx.eval(tok, top2)
        t2 = np.sort(np.asarray(top2), axis=-1)
        margins.append(t2[:, 1] - t2[:, 0])
        toks.append(np.asarray(tok))
        logits = model(tok[:, None].astype(mx.int32), cache=cache)[:, -1, :]
    return np.stack(toks, 1), np.stack(margins, 1), cache


def _forced(model, prompt, tokens):
    return np.asarray(fidelity.forced_logits(model, prompt, tokens))


MODELS = [("qwen3-tiny", 4), ("qwen3-tiny", 8), ("qwen3-tiny", None), ("llama-tiny", 4),
          ("llama-tiny", 8), ("qwen2-tiny", 4), ("qwen2-tiny", 8), ("qwen2-tiny", None)]


@pytest.mark.parametrize("name,bits", MODELS)
@pytest.mark.parametrize("batch", [1, 2])
def test_decode_vs_stock_and_fp32(name, bits, batch, monkeypatch):
    """A 300-token prompt (crossing the 256-token cache step), then GEN steps, batch 1 and 2."""
    monkeypatch.setenv("MLX_FASTOPS_BACKEND", "cuda")
    model = synthetic_model(name, bits=bits, dtype=mx.bfloat16, seed=batch)
    prompt = mx.random.randint(0, model.args.vocab_size, (batch, 300), key=mx.random.key(7))
    ref, _, _ = greedy(model, prompt, GEN)
    stock = _forced(model, prompt, ref)
    report = mlx_fastops.patch(model)
    try:
        if bits:
            assert any(e.fusion == "fast_decode" and e.status == "fused" for e in report.entries), str(report)
        got, _, cache = greedy(model, prompt, GEN)
        if bits:
            assert type(cache[0]).__name__ == "StaticKVCache"
        fused = _forced(model, prompt, ref)
    finally:
        mlx_fastops.unpatch(model)
    oracle = _forced(fidelity.fp32_oracle(synthetic_model(name, bits=bits, dtype=mx.bfloat16, seed=batch)),
                     prompt, ref)
    assert np.isfinite(fused).all(), "non-finite logits"
    err_s, err_p = np.abs(stock - oracle), np.abs(fused - oracle)
    top2 = np.sort(oracle, axis=-1)[..., -2:]
    best = oracle.argmax(-1)
    stock_clear = (top2[..., 1] - top2[..., 0] >= CLEAR) & (stock.argmax(-1) == best)
    for b in range(batch):
        diverge = np.nonzero(got[b] != ref[b])[0]
        print(f"{name} bits={bits} batch={batch} row {b}: |logit - fp32| mean/max stock "
              f"{err_s[b].mean():.3f}/{err_s[b].max():.2f}, patched {err_p[b].mean():.3f}/{err_p[b].max():.2f}; "
              f"top-1 = fp32: stock {(stock[b].argmax(-1) == best[b]).mean():.2f}, patched "
              f"{(fused[b].argmax(-1) == best[b]).mean():.2f}; free-running tokens = stock up to "
              f"{diverge[0] if len(diverge) else GEN}/{GEN}")
        assert stock_clear[b].sum() >= MIN_COMPARED, "too few clear steps to compare"
        assert (fused[b].argmax(-1)[stock_clear[b]] == best[b][stock_clear[b]]).all(), (b, np.nonzero(
            fused[b].argmax(-1) != best[b])[0])
    assert err_p.mean() <= 1.1 * err_s.mean(), (err_p.mean(), err_s.mean())


@pytest.mark.parametrize("compile_off", [False, True])
def test_fast_path_without_compile_matches(compile_off, monkeypatch):
    """The per-block path (compile disabled) and the compiled step give the same logits, up to
    the rounding of the stock element-wise ops that mx.compile fuses, and the same tokens."""
    monkeypatch.setenv("MLX_FASTOPS_BACKEND", "cuda")
    model = synthetic_model("qwen3-tiny", bits=4, dtype=mx.bfloat16, seed=3)
    prompt = mx.random.randint(0, 1000, (1, 20), key=mx.random.key(1))
    ref, _, _ = greedy(model, prompt, 32)
    runs = []
    for off in (False, True):
        report = mlx_fastops.patch(model, disable=("compile",) if off else ())
        try:
            compiled = any(e.fusion == "compile" and e.status == "fused" for e in report.entries)
            assert compiled != off
            runs.append(_forced(model, prompt, ref))
        finally:
            mlx_fastops.unpatch(model)
    with_compile, without = runs
    assert np.abs(with_compile - without).max() <= 0.02 * np.abs(without).max()
    top2 = np.sort(without, axis=-1)[..., -2:]
    clear = top2[..., 1] - top2[..., 0] >= CLEAR
    assert (with_compile.argmax(-1)[clear] == without.argmax(-1)[clear]).all()


REAL = ["qwen3-0.6b", "qwen3-4b", "qwen3-8b", "llama-3.2-1b", "qwen2.5-0.5b"]


@pytest.mark.parametrize("name", REAL)
def test_fast_block_real_sizes(name, monkeypatch):
    """One decoder block at real sizes, one decode token after a 260-position cache: the fused
    block (one launch, cache written in place) against the stock mlx-lm block on a KVCache."""
    from mlx_lm.models.cache import KVCache
    from mlx_fastops.backends.cuda.cache import StaticKVCache

    monkeypatch.setenv("MLX_FASTOPS_BACKEND", "cuda")
    model = synthetic_model(name, bits=4, layers=1, seed=4)
    a = model.args
    hkv = a.num_key_value_heads
    D = getattr(a, "head_dim", None) or a.hidden_size // a.num_attention_heads
    P = 260
    k0 = mx.random.normal((1, hkv, P, D), key=mx.random.key(1)).astype(mx.bfloat16)
    v0 = mx.random.normal((1, hkv, P, D), key=mx.random.key(2)).astype(mx.bfloat16)
    x = mx.random.normal((1, 1, a.hidden_size), key=mx.random.key(3)).astype(mx.bfloat16)
    ref_cache = KVCache()
    ref_cache.update_and_fetch(k0, v0)
    ref = model.model.layers[0](x, mask=None, cache=ref_cache)
    mx.eval(ref, ref_cache.keys)
    mlx_fastops.patch(model)
    try:
        cache = StaticKVCache()
        cache.update_and_fetch(k0, v0)
        mx.eval(cache.keys, cache.values)
        out = model.model.layers[0](x, mask=None, cache=cache)
        mx.eval(out)
    finally:
        mlx_fastops.unpatch(model)
    assert cache.offset == P + 1 and cache.last_reader is not None, "fast path not taken"
    for h in range(hkv):
        assert rel(cache.keys[0, h, P], ref_cache.keys[0, h, P]) < 2e-2, ("k", h)
        assert rel(cache.values[0, h, P], ref_cache.values[0, h, P]) < 2e-2, ("v", h)
    assert mx.array_equal(cache.keys[:, :, :P], k0) and mx.array_equal(cache.values[:, :, :P], v0)
    assert rel(out, ref) < 2e-2


def rel(a, b):
    a = np.asarray(a.astype(mx.float32)).astype(np.float64)
    b = np.asarray(b.astype(mx.float32)).astype(np.float64)
    assert np.isfinite(a).all(), "non-finite output"
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


@pytest.mark.parametrize("name", REAL)
@pytest.mark.parametrize("batch", [1, 2])
def test_real_sizes_two_layers(name, batch, monkeypatch):
    """Every kernel at the real shapes (hidden, heads, head_dim, vocab) of each model, 2 layers:
    teacher-forced logits of the fused decode path against stock after a 260-token prompt."""
    monkeypatch.setenv("MLX_FASTOPS_BACKEND", "cuda")
    model = synthetic_model(name, bits=4, layers=2, seed=5)
    prompt = mx.random.randint(0, model.args.vocab_size, (batch, 260), key=mx.random.key(2))
    ref, margins, _ = greedy(model, prompt, 12)
    ref_logits = _forced(model, prompt, ref)
    mlx_fastops.patch(model)
    try:
        got = _forced(model, prompt, ref)
    finally:
        mlx_fastops.unpatch(model)
    assert np.isfinite(got).all(), "non-finite logits"
    for step in range(got.shape[1]):
        for b in range(batch):
            a, r = got[b, step], ref_logits[b, step]
            err = np.abs(a - r).max() / np.abs(r).max()
            assert err < 0.05, (name, b, step, err)
            if margins[b, step] >= REAL_MARGIN:
                assert a.argmax() == r.argmax(), (name, b, step, margins[b, step])


@pytest.mark.slow
def test_qwen3_0p6b_patched_at_least_as_close_to_fp32_as_stock(monkeypatch):
    """Real-size bf16 greedy tokens of patched and stock diverge after a few tokens (stock adds
    4-bit GEMVs up in bf16, ours in fp32). Which is right: both against the float32 oracle, fed
    the same tokens, judged by the half-precision standard (fidelity.judge): no further from it
    than stock, and stock's token wherever stock's margin is clear. Most steps of this random model
    are near-ties (stock's own logits are up to ~3 off), where top-1 agreement is a coin toss either
    way: H200, 2026-12-04, 24 tokens, stock 23 / 24 vs patched 22 / 24 in one run, 22 vs 18 in
    another (both paths' figures moved: stock's greedy tokens, which both are fed, seem to vary run
    to run), no clear step changed; 48 tokens: mean |logit error| stock 0.463, patched 0.371, top-1
    0.875 vs 0.917, 7 clear steps, none changed."""
    monkeypatch.setenv("MLX_FASTOPS_BACKEND", "cuda")
    model = synthetic_model("qwen3-0.6b", bits=4)
    prompt = mx.random.randint(0, 151936, (260,), key=mx.random.key(3))
    tokens = greedy(model, prompt[None], 48)[0][0].tolist()
    oracle = fidelity.forced_logits(fidelity.fp32_oracle(synthetic_model("qwen3-0.6b", bits=4)), prompt, tokens)
    stock = fidelity.forced_logits(model, prompt, tokens)
    mlx_fastops.patch(model)
    try:
        fused = fidelity.forced_logits(model, prompt, tokens)
    finally:
        mlx_fastops.unpatch(model)
    verdict = fidelity.judge(stock, fused, oracle)
    print(f"qwen3-0.6b vs float32: stock {verdict['stock']}, patched {verdict['patched']}, "
          f"clear steps {verdict['clear']}, changed {verdict['changed']}")
    assert verdict["clear"] >= 3, f"only {verdict['clear']} of 48 steps have a clear margin: nothing to judge"
    assert not verdict["problems"], verdict["problems"]


@pytest.mark.parametrize("name,layers", [("qwen3-0.6b", 8), ("llama-3.2-1b", 8), ("qwen3-4b", 3)])
def test_layers_in_one_launch_bitwise_at_real_sizes(name, layers, monkeypatch):
    """All layers of a real-size model in one launch give exactly the per-layer launches' output and
    cache rows, and the same again on a rerun; the compiled decode step's logits are the same with
    every layer in one launch as with one per launch (what the emulator's tiny models cannot show:
    NVRTC inlines a tiny launch whole, while a long launch with a call site per layer had out-of-line
    phases that rounded differently)."""
    from mlx_fastops.backends.cuda import block, layer, source, step

    monkeypatch.setenv("MLX_FASTOPS_BACKEND", "cuda")
    model = synthetic_model(name, bits=4, layers=layers, dtype=mx.bfloat16)
    mlx_fastops.patch(model, disable="compile")
    try:
        fbs = [b.fast_fn for b in model.model.layers]
        D, HKV, K = fbs[0].D, fbs[0].HKV, model.args.hidden_size
        for trial in range(3):
            caches = [[mx.random.normal((1, HKV, 1024, D)).astype(mx.bfloat16) for _ in range(2)] for _ in fbs]
            x = (4 * mx.random.normal((1, 1, K))).astype(mx.bfloat16)
            off = source.offset_array(600 + 37 * trial)
            runs = []
            for together in (False, True, True):   # per layer, one launch, its rerun
                bufs = [(kc + 0, vc + 0) for kc, vc in caches]
                mx.eval(bufs)
                if together:
                    out, _ = layer.layers_launch(fbs, x, off, [(kc, vc, kc) for kc, vc in bufs])
                else:
                    out = x
                    for fb, (kc, vc) in zip(fbs, bufs):
                        out, _ = fb.core(out, off, kc, vc, kc)
                mx.eval(out)
                runs.append((out, bufs))
            (out1, bufs1), *launched = runs
            for run, (out2, bufs2) in enumerate(launched):
                assert mx.array_equal(out1, out2), f"trial {trial}, run {run}: output differs"
                for j, ((k1, v1), (k2, v2)) in enumerate(zip(bufs1, bufs2)):
                    assert mx.array_equal(k1, k2) and mx.array_equal(v1, v2), f"trial {trial}: layer {j}'s cache"
    finally:
        mlx_fastops.unpatch(model)
    # the compiled decode step, teacher-forced: every layer in one launch, then one per launch
    prompt = mx.random.randint(0, 1000, (64,), key=mx.random.key(1))
    tokens = mx.random.randint(0, 1000, (12,), key=mx.random.key(2))
    logits = {}
    for limit, shared_rows in ((block.GROUP_MAX_WEIGHTS, 1), (0, 0)):
        monkeypatch.setattr(block, "GROUP_MAX_WEIGHTS", limit)
        monkeypatch.setattr(step, "LARGE_SHARED_MAX_ROWS", shared_rows)
        m = synthetic_model(name, bits=4, layers=layers, dtype=mx.bfloat16)
        mlx_fastops.patch(m)
        per_launch = max(n for _, n in step.launch_runs([b.fast_fn for b in m.model.layers], 1))
        logits[per_launch] = [fidelity.forced_logits(m, prompt, tokens) for _ in range(2)]
        mx.eval(logits[per_launch])
        del m
    assert sorted(logits) == [1, layers]
    first = logits[layers][0]
    for per_launch, runs in logits.items():
        for run in runs:
            assert mx.array_equal(first, run), f"{per_launch} layer(s) per launch"
