"""The CUDA backend's prefill projections (backends/cuda/prefill.py): dense matmuls on weights
dequantised per call, against the float32 evaluation of the same quantised weights, no further
from it than stock quantized_matmul (plus a rounding slack per dtype). Pure MLX ops: they run on
any device (here MLX's CPU), on the H200 under `pytest -m cuda`."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_fastops.backends import reference
from mlx_fastops.backends.cuda import gemv, prefill, qmm
from mlx_fastops.ops.weights import PackedLinear

pytestmark = [pytest.mark.cuda]
TOL = {mx.float16: 2e-3, mx.bfloat16: 1.6e-2}


def packed(N, K, bits, gs, dtype, bias=False, splits=None):
    wq, s, b = mx.quantize(mx.random.normal((N, K)) * 0.05, group_size=gs, bits=bits)
    return PackedLinear(wq, s.astype(dtype), b.astype(dtype),
                        (0.1 * mx.random.normal((N,))).astype(dtype) if bias else None,
                        tuple(splits or (N,)), K, bits, gs)


def err(y, exact):
    y = np.asarray(y.astype(mx.float32)).astype(np.float64)
    assert np.isfinite(y).all()
    return float(np.abs(y - exact).max() / np.abs(exact).max())


def exact_of(x, w):
    W = mx.dequantize(w.weight, w.scales.astype(mx.float32), w.biases.astype(mx.float32),
                      group_size=w.group_size, bits=w.bits)
    y = np.asarray(x.astype(mx.float32)).astype(np.float64) @ np.asarray(W).astype(np.float64).T
    return y if w.bias is None else y + np.asarray(w.bias.astype(mx.float32))


# (rows M, in K, out N, bits, group, dtype, bias): M not a tile multiple, K/N of the benchmark models'
# projections (scaled down where the CPU would take long), 4/8 bits, groups 32/64/128
CASES = [(512, 1024, 4096, 4, 64, mx.bfloat16, False), (100, 2560, 1536, 4, 128, mx.bfloat16, True),
         (257, 896, 1152, 8, 32, mx.float16, True), (300, 4096, 640, 8, 64, mx.bfloat16, False),
         (700, 320, 200, 4, 32, mx.float16, False)]


@pytest.mark.parametrize("M,K,N,bits,gs,dtype,bias", CASES)
def test_prefill_linear_as_close_as_stock(M, K, N, bits, gs, dtype, bias):
    mx.random.seed(M)
    w = packed(N, K, bits, gs, dtype, bias)
    x = mx.random.normal((1, M, K)).astype(dtype)
    exact = exact_of(x, w)
    ours, stock = err(prefill.linear(x, w), exact), err(reference.linear(x, w), exact)
    assert ours <= stock + TOL[dtype], (ours, stock)


def test_transient_weight_waits_for_the_input():
    """The dequantised weight is made after the matmul's input (mx.depends), so a prompt chunk's
    layers do not dequantise all their weights up front: one call's graph has the input among the
    weight's dependencies."""
    w = packed(256, 128, 4, 64, mx.bfloat16)
    x = mx.random.normal((1, 600, 128)).astype(mx.bfloat16) * 2
    y = prefill.linear(x, w)
    assert mx.array_equal(y, x @ prefill.dense(w).T)


@pytest.mark.parametrize("transform", [None, mx.compile])
def test_calls_in_flight_are_bounded(transform):
    """Each prefill call waits for the one IN_FLIGHT_MAX calls back, so a prompt chunk's layers do
    not all hold their transient weights at once: after more calls than that, only the last
    IN_FLIGHT_MAX are pending. Inside mx.compile (where nothing may be evaluated) the calls
    are left to the caller's graph, with the same result."""
    w = packed(256, 128, 4, 64, mx.bfloat16)
    x = mx.random.normal((1, 600, 128)).astype(mx.bfloat16)
    prefill._in_flight.clear()
    layers = lambda x: [prefill.linear(x, w) for _ in range(3 * prefill.IN_FLIGHT_MAX)][-1]
    y = (transform or (lambda f: f))(layers)(x)
    assert len(prefill._in_flight) == (0 if transform else prefill.IN_FLIGHT_MAX)
    assert mx.array_equal(y, x @ prefill.dense(w).T)


@pytest.mark.parametrize("M,paths", [(1, ["gemv"] * 3 + ["stock"]), (2, ["gemv", "gemv", "qmm", "stock"]),
                                     (8, ["gemv", "gemv", "qmm", "stock"]), (9, ["qmm"] * 4),
                                     (64, ["qmm"] * 4), (65, ["stock"] * 4), (511, ["stock"] * 4),
                                     (512, ["dense", "dense", "stock", "dense"])])
def test_rows_pick_the_path(M, paths, monkeypatch):
    """Up to MAX_ROWS rows the GEMV kernel (not for linear: o_proj / down; lm_head only at one row),
    then up to QMM_MAX_ROWS the tensor-core qmm, then stock quantized_matmul, from PREFILL_MIN_ROWS the dense
    prefill path, for QKV, gate/up and linear (lm_head's prefill stays stock: its output is the whole
    vocabulary a row): seen by which of the four functions each op calls."""
    seen, stock = [], reference.linear
    monkeypatch.setattr(gemv, "gemv", lambda x, w, epi=0, **k: seen.append("gemv") or
                        mx.zeros((x.shape[0], w.out_features // (2 if epi == 2 else 1)), x.dtype))
    monkeypatch.setattr(qmm, "qmm", lambda x, w, epi=0: seen.append("qmm") or
                        mx.zeros((*x.shape[:-1], w.out_features // (2 if epi == 2 else 1)), x.dtype))
    monkeypatch.setattr(prefill, "linear", lambda x, w: seen.append("dense") or stock(x, w))
    for name in ("linear", "lm_head"):
        monkeypatch.setattr(reference, name, lambda x, w: seen.append("stock") or stock(x, w))
    qkv = packed(384, 256, 4, 64, mx.bfloat16, splits=(256, 64, 64))
    gu = packed(512, 256, 4, 64, mx.bfloat16, splits=(256, 256))
    x = mx.random.normal((1, M, 256)).astype(mx.bfloat16)
    q, k, v = gemv.qkv_proj(x, qkv)
    h = gemv.gate_up_silu(x, gu)
    y = gemv.lm_head(x, qkv)
    o = gemv.linear(x, gu)
    assert (q.shape, k.shape, v.shape, h.shape, y.shape, o.shape) == (
        (1, M, 256), (1, M, 64), (1, M, 64), (1, M, 256), (1, M, 384), (1, M, 512))
    assert seen == paths, seen


# (activations, scales, float32 matmuls in TF32, taken at 512 rows): float32 only where the dense
# matmul is as precise as stock's quantized_matmul
TAKES = [(mx.bfloat16, mx.bfloat16, True, True), (mx.float16, mx.float16, True, True),
         (mx.float32, mx.float32, False, True), (mx.float32, mx.float32, True, False),
         (mx.bfloat16, mx.float32, False, False)]


@pytest.mark.parametrize("xdtype,sdtype,tf32,taken", TAKES)
def test_dense_path_takes(xdtype, sdtype, tf32, taken, monkeypatch):
    monkeypatch.setattr(prefill, "tf32_matmul", lambda: tf32)
    w = packed(64, 128, 4, 64, sdtype)
    assert prefill.takes(mx.zeros((1, prefill.PREFILL_MIN_ROWS, 128), xdtype), w) is taken
    assert not prefill.takes(mx.zeros((1, prefill.PREFILL_MIN_ROWS - 1, 128), xdtype), w)
    assert (gemv.unsupported_linear(**w.info()) is None) is (sdtype != mx.float32 or not tf32)


# (MLX_ENABLE_TF32, a CUDA GPU, TF32): MLX's default is TF32 on a CUDA GPU
TF32 = [(None, True, True), ("0", True, False), ("1", True, True), ("0", False, False), (None, False, False)]


@pytest.mark.parametrize("env,gpu,tf32", TF32)
def test_tf32_matmul(env, gpu, tf32, monkeypatch):
    if env is None:
        monkeypatch.delenv("MLX_ENABLE_TF32", raising=False)
    else:
        monkeypatch.setenv("MLX_ENABLE_TF32", env)
    monkeypatch.setattr(mx.cuda, "is_available", lambda: gpu)
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu if gpu else mx.cpu))
    prefill._tf32_variable.cache_clear()
    try:
        assert prefill.tf32_matmul() is tf32
    finally:
        prefill._tf32_variable.cache_clear()


@pytest.mark.parametrize("disable,dense", [((), True), (("prefill",), False)])
def test_prefill_switch(disable, dense, monkeypatch):
    """A patched model's prompt runs the dense prefill path (QKV, gate/up, o_proj, down: 4 calls a
    layer) unless `prefill` is switched off (then stock quantized_matmul, and the report says so);
    decode keeps the kernels either way."""
    import cuda_emu
    from mlx_fastops import kernels, synthetic_model
    import mlx_fastops

    monkeypatch.setenv("MLX_FASTOPS_BACKEND", "cuda")
    calls, dense_linear = [], prefill.linear
    monkeypatch.setattr(prefill, "linear", lambda x, w: calls.append(x.shape) or dense_linear(x, w))
    model = synthetic_model("qwen3-tiny", bits=4, dtype=mx.bfloat16)
    prompt = mx.random.randint(0, 4096, (1, 520), key=mx.random.key(0))
    ref = model(prompt)
    with kernels.use_cuda_factory(cuda_emu.cuda_kernel):
        report = mlx_fastops.patch(model, disable=("compile", *disable))
        try:
            calls.clear()
            got = model(prompt)
        finally:
            mlx_fastops.unpatch(model)
    notes = {e.reason for e in report.fused if e.fusion in ("qkv", "gate_up")}
    assert len(calls) == (4 * len(model.layers) if dense else 0), calls
    assert (notes == {"prefill off: stock"}) is (not dense), notes
    projections = {(e.where.rsplit(".", 1)[1], e.status) for e in report.entries if e.fusion == "prefill"}
    assert projections == {("o_proj", "fused" if dense else "skipped"), ("down_proj", "fused" if dense else "skipped")}
    assert np.abs(np.asarray((got - ref).astype(mx.float32))).max() <= 0.1 * np.abs(np.asarray(ref.astype(mx.float32))).max()


# (batch, prompt chunks, dtype): one-shot, mlx-lm's chunked prefill into one cache, several prompts
# at once; bf16, which takes the dense path on a GPU too (float32 there runs in TF32: stock's)
WHOLE_MODEL = [(1, (1030,), mx.float32), (1, (520, 515), mx.float32), (3, (530,), mx.float32),
               (2, (512, 600), mx.float32), (1, (520, 515), mx.bfloat16), (2, (512, 600), mx.bfloat16)]
WHOLE_TOL = {mx.float32: 1e-4, mx.bfloat16: 0.1}   # bf16: 0.1 of the largest logit (no garbage)


@pytest.mark.parametrize("B,chunks,dtype", WHOLE_MODEL,
                         ids=[f"B{b}-{'+'.join(map(str, c))}-{str(d).split('.')[-1]}" for b, c, d in WHOLE_MODEL])
def test_prefill_path_in_a_whole_model(B, chunks, dtype, monkeypatch):
    """A prompt through a patched model, one-shot or in chunks into the same cache (each chunk a
    call of 512 rows or more), one or several prompts at once: every chunk's projections take the
    dense path (4 calls a layer), and the logits equal stock's up to float32 summation order
    (float32 activations, so the dense and the quantised matmul differ only in that order). On a
    CUDA GPU float32 matmuls run in TF32 (MLX's default): there none takes the dense path."""
    import cuda_emu
    from mlx_lm.models.cache import make_prompt_cache

    import mlx_fastops
    from mlx_fastops import kernels, synthetic_model

    monkeypatch.setenv("MLX_FASTOPS_BACKEND", "cuda")
    calls, dense_linear = [], prefill.linear
    monkeypatch.setattr(prefill, "linear", lambda x, w: calls.append(x.shape[:-1]) or dense_linear(x, w))
    model = synthetic_model("qwen3-tiny", bits=4, dtype=dtype)
    prompt = mx.random.randint(0, 4096, (B, sum(chunks)), key=mx.random.key(B))

    def run():
        cache, out, start = make_prompt_cache(model), [], 0
        for n in chunks:
            out.append(model(prompt[:, start:start + n], cache=cache))
            start += n
        return np.asarray(mx.concatenate(out, axis=1).astype(mx.float32))

    want = run()
    with kernels.use_cuda_factory(cuda_emu.cuda_kernel):
        mlx_fastops.patch(model, disable=("compile",))
        try:
            got = run()
        finally:
            mlx_fastops.unpatch(model)
    dense = [(B, n) for n in chunks for _ in range(4 * len(model.layers))]
    assert calls == ([] if dtype == mx.float32 and prefill.tf32_matmul() else dense), calls
    assert np.abs(got - want).max() <= WHOLE_TOL[dtype] * np.abs(want).max()
