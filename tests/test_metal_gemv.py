"""The Metal quantised GEMV family (metal/gemv.metal) against the reference ops.

On Linux every kernel runs in the CPU emulator (tests/metal_emu: poisoned outputs and threadgroup
memory, forward/reversed schedules, guard pages): results are emulator-verified, not Metal-verified.
On a Mac with Metal the same tests run the kernels on the GPU.

Grid: bits 4/8 x group 32/64/128 x fp16/bf16 for each kernel, sizes that are not tile multiples
(K = 256+64 ... 512+128 around the 512/256-value K block, N = 96+33, qkv K/V segments smaller than
the q segment, gate/up widths not multiples of 4), 1 to 8 activation rows (every row bucket and the
masked rows inside a bucket), biases, both variants. Every scale tensor is checked to contain
negative scales. The strict compile tier covers every instantiation the wrappers can launch.
"""

import itertools
import math
import os

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_fastops import ops
from mlx_fastops.backends import reference
from mlx_fastops.backends.metal import gemv as G
from mlx_fastops.ops.weights import PackedLinear

metal = pytest.mark.metal  # kernel-running tests: emulator on Linux, GPU on a Mac (metal_fixtures)

TOL = {mx.float16: 1e-2, mx.bfloat16: 2e-2}
TOL_INT8 = {mx.float16: 8e-2, mx.bfloat16: 8e-2}
# x quantised to int8 per row: 1.5-4.5% max relative error on this grid (matches a NumPy model of
# the same quantisation exactly): the error scales with |scale*q|, not |w|, since the affine bias
# part is applied to the raw float sum of x.


# ---------------------------------------------------------------------------------------------
# data


def packed(splits, k, bits, group, dtype, bias=False, seed=0):
    """Stacked quantised layers exactly as the patcher builds them (QuantizedLinear.from_linear)."""
    mx.random.seed(seed)
    layers = []
    for n in splits:
        lin = nn.Linear(k, n, bias=bias)
        lin.weight = mx.random.normal((n, k)) * 0.5
        if bias:
            lin.bias = mx.random.normal((n,))
        lin.set_dtype(dtype)
        layers.append(nn.QuantizedLinear.from_linear(lin, group, bits))
    mx.eval([l.parameters() for l in layers])
    w = PackedLinear.stack(layers)
    assert (np.array(w.scales.astype(mx.float32)) < 0).any(), "grid must include negative scales"
    return w


def activations(shape, dtype, seed=1):
    mx.random.seed(seed)
    return mx.random.normal(shape).astype(dtype)


def x_shape(m, k, i):
    """[B, L, K] with B*L = m, alternating batch and sequence layouts."""
    return (m, 1, k) if i % 2 else (1, m, k)


def to_np(a):
    return np.array(a.astype(mx.float32))


def rel_err(out, ref):
    a, b = to_np(out), to_np(ref)
    assert a.shape == b.shape, (a.shape, b.shape)
    assert np.isfinite(a).all(), "non-finite (unwritten or poisoned) output"
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-6))


def exact_linear(x, w):
    """float64 x @ dequant(W)^T (+ bias): the exact value both stock and our kernels approximate."""
    wd = np.array(mx.dequantize(w.weight, w.scales, w.biases, w.group_size, w.bits).astype(mx.float32),
                  dtype=np.float64)
    y = np.array(x.astype(mx.float32), dtype=np.float64) @ wd.T
    if w.bias is not None:
        y = y + to_np(w.bias)
    return y


def check(out, ref, exact, tol):
    """Within `tol` of the exact value, and of the reference up to the reference's own error (stock
    quantized_matmul on the CPU accumulates bf16 in bf16: several % off the exact value at K ~ 500)."""
    e_ref = rel_err(out, ref)
    a, r = to_np(out).astype(np.float64), to_np(ref).astype(np.float64)
    scale = max(np.abs(exact).max(), 1e-6)
    e_exact = float(np.abs(a - exact).max() / scale)
    e_ref_exact = float(np.abs(r - exact).max() / scale)
    assert e_exact <= tol, f"rel err vs exact {e_exact:.2e} (reference: {e_ref_exact:.2e})"
    assert e_ref <= tol + e_ref_exact, f"rel err vs reference {e_ref:.2e} (reference vs exact {e_ref_exact:.2e})"


# ---------------------------------------------------------------------------------------------
# the grid: every (bits, group, dtype) for every kernel; rows 1..8 cycle through the cases


def _k_for(group, i):
    # around the K block (512 values for 4-bit, 256 for 8-bit): below it, one block + tail, two+
    options = {32: (256 + 64, 512 + 32, 96), 64: (256 + 64, 512 + 64, 192), 128: (384, 512 + 128, 256)}
    return options[group][i % 3]


COMBOS = list(itertools.product((4, 8), (32, 64, 128), (mx.float16, mx.bfloat16)))
CASES = [(bits, group, dtype, _k_for(group, i), 1 + i % 8, i) for i, (bits, group, dtype) in enumerate(COMBOS)]


def _id(c):
    bits, group, dtype, k, m, _ = c
    return f"q{bits}-g{group}-{str(dtype).split('.')[-1]}-k{k}-m{m}"


@metal
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_qkv_proj(case):
    bits, group, dtype, k, m, i = case
    splits = [(96 + 33, 33, 33), (64, 16, 16), (128 + 8, 40, 40)][i % 3]
    w = packed(splits, k, bits, group, dtype, bias=(i % 4 == 3), seed=i)
    x = activations(x_shape(m, k, i), dtype, seed=100 + i)
    out = G.qkv_proj(x, w, var="prescaled")
    ref = reference.qkv_proj(x, w)
    exact = exact_linear(x, w)
    bounds = np.cumsum((0,) + splits)
    for j, (o, r) in enumerate(zip(out, ref)):
        assert o.shape == r.shape and o.dtype == dtype
        check(o, r, exact[..., bounds[j]:bounds[j + 1]], TOL[dtype])


@metal
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_gate_up_silu(case):
    bits, group, dtype, k, m, i = case
    inter = (66, 96 + 33, 37)[i % 3]
    w = packed((inter, inter), k, bits, group, dtype, bias=(i % 4 == 1), seed=i)
    x = activations(x_shape(m, k, i + 1), dtype, seed=200 + i)
    out = G.gate_up_silu(x, w, var="prescaled")
    ref = reference.gate_up_silu(x, w)
    e = exact_linear(x, w)
    g, u = e[..., :inter], e[..., inter:]
    exact = g / (1 + np.exp(-g)) * u
    assert out.shape == ref.shape and out.dtype == dtype
    check(out, ref, exact, TOL[dtype])


@metal
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_lm_head(case):
    bits, group, dtype, k, m, i = case
    w = packed((96 + 33 + 8 * (i % 3),), k, bits, group, dtype, bias=(i % 4 == 2), seed=i)
    x = activations(x_shape(m, k, i), dtype, seed=300 + i)
    out = G.lm_head(x, w)
    ref = reference.lm_head(x, w)
    assert out.shape == ref.shape and out.dtype == dtype
    check(out, ref, exact_linear(x, w), TOL[dtype])


# ---------------------------------------------------------------------------------------------
# the int8-activation variant (selectable, not default)

INT8_CASES = [c for c in CASES if c[5] % 2 == 0] + [c for c in CASES if c[5] % 2][:2]


@metal
@pytest.mark.parametrize("case", INT8_CASES, ids=_id)
def test_int8_variant(case):
    bits, group, dtype, k, m, i = case
    w = packed((72, 24, 24), k, bits, group, dtype, seed=i)
    x = activations(x_shape(m, k, i), dtype, seed=400 + i)
    exact = exact_linear(x, w)
    for o, r, sl in zip(G.qkv_proj(x, w, var="int8"), reference.qkv_proj(x, w),
                        (slice(0, 72), slice(72, 96), slice(96, 120))):
        check(o, r, exact[..., sl], TOL_INT8[dtype])
    wg = packed((40, 40), k, bits, group, dtype, seed=i + 50)
    e = exact_linear(x, wg)
    exact = e[..., :40] / (1 + np.exp(-e[..., :40])) * e[..., 40:]
    check(G.gate_up_silu(x, wg, var="int8"), reference.gate_up_silu(x, wg), exact, TOL_INT8[dtype])
    wl = packed((77,), k, bits, group, dtype, bias=True, seed=i + 60)
    check(G.gemv(x, wl, var="int8"), reference.lm_head(x, wl), exact_linear(x, wl), TOL_INT8[dtype])


@metal
def test_variant_switch():
    w = packed((40,), 320, 4, 64, mx.float16)
    x = activations((1, 1, 320), mx.float16)
    old = G.set_variant("int8")
    try:
        assert G.variant() == "int8"
        check(G.lm_head(x, w), reference.lm_head(x, w), exact_linear(x, w), TOL_INT8[mx.float16])
    finally:
        G.set_variant(old)
    with pytest.raises(ValueError, match="unknown GEMV variant"):
        G.set_variant("int4")


# ---------------------------------------------------------------------------------------------
# fallbacks and support decisions


@metal
def test_more_than_eight_rows_falls_back():
    w = packed((40, 8, 8), 256, 4, 64, mx.float16)
    x = activations((1, 9, 256), mx.float16)
    for o, r in zip(G.qkv_proj(x, w), reference.qkv_proj(x, w)):
        assert mx.array_equal(o, r)  # the reference op itself: identical


@metal
def test_dtype_mismatch_falls_back():
    w = packed((40,), 256, 4, 64, mx.bfloat16)
    x = activations((1, 1, 256), mx.float16)
    assert mx.array_equal(G.lm_head(x, w), reference.lm_head(x, w))


def _info(**kw):
    base = dict(in_features=1024, splits=(1024, 512, 512), bits=4, group_size=64, dtype=mx.bfloat16,
                bias=False)
    base.update(kw)
    return base


@pytest.mark.parametrize("kw, reason", [
    (dict(bits=None), "float weights"),
    (dict(bits=3), "bits=3"),
    (dict(bits=2, group_size=64), "bits=2"),
    (dict(group_size=16), "group_size=16"),
    (dict(dtype=mx.float32), "dtype"),
    (dict(splits=(4, 1, 1), in_features=64), "too small"),
])
def test_unsupported_shape_classes(kw, reason):
    for fn in (G.unsupported_qkv_proj, G.unsupported_lm_head):
        assert reason in fn(**_info(**kw))
    gate_up = dict(kw, splits=(2, 2) if "splits" in kw else (2048, 2048))
    assert reason in G.unsupported_gate_up_silu(**_info(**gate_up))


def test_supported_shape_classes_select_the_kernels():
    assert G.unsupported_qkv_proj(**_info()) is None
    assert G.unsupported_gate_up_silu(**_info(splits=(3072, 3072))) is None
    assert G.unsupported_lm_head(**_info(splits=(151936,))) is None
    assert "2 equal" in G.unsupported_gate_up_silu(**_info(splits=(3072, 1024)))
    fn, used, reason = ops.select("qkv_proj", "metal", **_info())
    assert (fn, used, reason) == (G.qkv_proj, "metal", None)
    fn, used, reason = ops.select("lm_head", "metal", **_info(bits=5))
    assert used == "reference" and "bits=5" in reason


@pytest.mark.parametrize("switch, op", [("qkv_kernel", "qkv_proj"), ("gate_up_kernel", "gate_up_silu"),
                                        ("lm_head_kernel", "lm_head")])
def test_kill_switches(monkeypatch, switch, op):
    info = _info(splits=(1024, 1024)) if op == "gate_up_silu" else _info()
    assert ops.select(op, "metal", **info)[1] == "metal"
    monkeypatch.setenv("MLX_FASTOPS_DISABLE", switch)
    fn, used, reason = ops.select(op, "metal", **info)
    assert used == "reference" and switch in reason


# ---------------------------------------------------------------------------------------------
# the segmented qkv grid: each segment gets exactly its own tiles (the small K/V slices do not idle)


@metal
def test_qkv_grid_is_segmented(monkeypatch):
    calls = []
    real = G._launch

    def spy(kind, x2, w, params, tiles, out_shapes, var):
        calls.append((kind, tiles, [int(p) for p in np.array(params)]))
        return real(kind, x2, w, params, tiles, out_shapes, var)

    monkeypatch.setattr(G, "_launch", spy)
    w = packed((128 + 8, 40, 40), 256, 4, 64, mx.float16)
    G.qkv_proj(activations((1, 1, 256), mx.float16), w)
    (kind, tiles, p), = calls
    assert kind == "qkv" and tiles == math.ceil(136 / 8) + 2 * math.ceil(40 / 8)
    assert p[4:9] == [136, 40, 40, 17, 22]


# ---------------------------------------------------------------------------------------------
# strict compile tier: every instantiation the wrappers can launch


def _strict_inputs(kind, dtype, bits, mr):
    k, n = 256, 64
    return [mx.zeros((mr, k), dtype), mx.zeros((n, k * bits // 32), mx.uint32), mx.zeros((n, k // 64), dtype),
            mx.zeros((n, k // 64), dtype), mx.zeros((8,), dtype), mx.zeros((9,), mx.int32)]


def _strict_spec(inst):
    kind, var, dtype, bits, mr = inst
    header, bodies = G.sections()
    name = G.kernel_name(kind, var)
    spec = dict(name=f"fastops_{name}", input_names=G.INPUTS, output_names=G._OUTPUTS[kind],
                source=bodies[name], header=header)
    call = dict(inputs=_strict_inputs(kind, dtype, bits, mr), output_dtypes=[dtype] * len(G._OUTPUTS[kind]),
                template=[("T", dtype), ("BITS", bits), ("MR", mr)], grid=(64, 1, 1), threadgroup=(64, 1, 1))
    return spec, call


@pytest.fixture(scope="module")
def strict_warm():
    """Compile every instantiation once, on all cores (g++ runs in subprocesses), before the
    per-instantiation tests; they then hit metal_emu's strict cache. A failure here is ignored: the
    test of that instantiation compiles it again and reports the error."""
    emu = pytest.importorskip("metal_emu")
    from concurrent.futures import ThreadPoolExecutor

    from metal_emu.source import mlx_source
    from metal_emu.strict import check_strict

    jobs = []
    for inst in G.instantiations():
        spec, call = _strict_spec(inst)
        spec = dict(spec, ensure_row_contiguous=True, atomic_outputs=False, compile_options=None)
        _, src, _ = mlx_source(spec, call["inputs"], [(1,)] * len(spec["output_names"]), call["output_dtypes"],
                               call["grid"], call["threadgroup"], call["template"], None)
        jobs.append((src, spec["header"], spec["source"], spec["name"]))

    def one(job):
        try:
            check_strict(*job)
        except Exception:  # reported by the test of this instantiation
            pass

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=min(8, max(1, cores))) as pool:
        list(pool.map(one, jobs))
    return emu


@pytest.mark.parametrize("inst", G.instantiations(), ids=lambda t: "-".join(str(v).split(".")[-1] for v in t))
def test_strict_compile(strict_warm, inst):
    spec, call = _strict_spec(inst)
    strict_warm.compile_strict(**spec, **call)


# ---------------------------------------------------------------------------------------------
# real decode shapes (slow in the emulator): Qwen3-0.6B q/k/v and gate/up, a down_proj-sized plain
# GEMV (K = 3072: six 512-value blocks) and an lm_head slice


REAL = [
    ("qkv", (2048, 1024, 1024), 1024, 4, 64, mx.bfloat16, 1),
    ("gate_up", (3072, 3072), 1024, 4, 64, mx.bfloat16, 1),
    ("gemv", (1024,), 3072, 4, 64, mx.float16, 2),
    ("gemv", (4099,), 1024, 8, 64, mx.bfloat16, 1),
]


@pytest.mark.slow
@metal
@pytest.mark.parametrize("kind, splits, k, bits, group, dtype, m", REAL,
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v).split(".")[-1])
def test_real_decode_shapes(kind, splits, k, bits, group, dtype, m):
    w = packed(splits, k, bits, group, dtype, seed=7)
    x = activations((1, m, k), dtype, seed=8)
    exact = exact_linear(x, w)
    if kind == "qkv":
        bounds = np.cumsum((0,) + splits)
        for j, (o, r) in enumerate(zip(G.qkv_proj(x, w), reference.qkv_proj(x, w))):
            check(o, r, exact[..., bounds[j]:bounds[j + 1]], TOL[dtype])
    elif kind == "gate_up":
        g, u = exact[..., :splits[0]], exact[..., splits[0]:]
        check(G.gate_up_silu(x, w), reference.gate_up_silu(x, w), g / (1 + np.exp(-g)) * u, TOL[dtype])
    else:
        check(G.gemv(x, w), reference.linear(x, w), exact, TOL[dtype])


def test_variant_from_environment(monkeypatch):
    monkeypatch.setenv("MLX_FASTOPS_GEMV_VARIANT", "int8")
    assert G._env_variant() == "int8"
    monkeypatch.setenv("MLX_FASTOPS_GEMV_VARIANT", "int4")
    with pytest.raises(ValueError, match="MLX_FASTOPS_GEMV_VARIANT"):
        G._env_variant()
    monkeypatch.delenv("MLX_FASTOPS_GEMV_VARIANT")
    assert G._env_variant() == "prescaled"
