"""Tests of the Metal emulation harness (tests/metal_emu), table-driven like llama.cpp's test-backend-ops.

GOOD: kernels that must match NumPy. They take `metal_kernel_factory`, so they run in the emulator on
Linux and on the GPU where Metal exists, with the same assertions.
BAD: kernels with one bug each; the emulator must reject each with the check meant for it.
"""

import dataclasses
import shutil
import sys
from typing import Callable

import mlx.core as mx
import numpy as np
import pytest

import metal_emu

# the emulator itself needs Linux (ucontext fibers, guard pages via mmap/SIGSEGV) and g++; the GOOD kernels
# run everywhere (on a Mac through mx.fast.metal_kernel)
emulator_only = pytest.mark.skipif(not sys.platform.startswith("linux") or shutil.which("g++") is None,
                                   reason="metal_emu runs on Linux with g++")

# ------------------------------------------------------------------------------------------ kernels
ROWSUM = """
uint row = threadgroup_position_in_grid.x;
uint tid = thread_index_in_threadgroup;
uint lane = thread_index_in_simdgroup;
uint sg = simdgroup_index_in_threadgroup;
threadgroup float partial[32];
int n = inp_shape[1];
float acc = 0.0f;
for (int i = int(tid); i < n; i += int(threads_per_threadgroup.x)) {
  acc += float(inp[row * n + i]);
}
acc = simd_sum(acc);
if (lane == 0) {
  partial[sg] = acc;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
if (sg == 0) {
  float v = lane < simdgroups_per_threadgroup ? partial[lane] : 0.0f;
  v = simd_sum(v);
  if (lane == 0) {
    out[row] = T(v);
  }
}
"""

MATMUL = """
// C[M, N] = A[M, K] @ B[K, N] (or B given transposed as [N, K]); one 8x8 tile per SIMD-group
uint sg = simdgroup_index_in_threadgroup;
uint tm = sg / (N / 8), tn = sg % (N / 8);
simdgroup_matrix<T, 8, 8> a;
simdgroup_matrix<T, 8, 8> b;
simdgroup_float8x8 c = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
for (uint k = 0; k < K; k += 8) {
  simdgroup_load(a, A, K, ulong2(k, tm * 8));
  if (TRANS_B) {
    simdgroup_load(b, B, K, ulong2(k, tn * 8), true);
  } else {
    simdgroup_load(b, B, N, ulong2(tn * 8, k));
  }
  simdgroup_multiply_accumulate(c, a, b, c);
}
simdgroup_store(c, C, N, ulong2(tn * 8, tm * 8));
"""

FRAGMENT = """
simdgroup_float8x8 m;
simdgroup_load(m, inp, 8);
uint l = thread_index_in_simdgroup;
out[2 * l] = m.thread_elements()[0];
out[2 * l + 1] = m.thread_elements()[1];
"""

VEC_ELEMENTWISE = """
uint i = thread_position_in_grid.x;
if (i >= uint(x_shape[0]) / 4) {
  return;
}
half4 h = ((const device half4*)x)[i];
uchar4 u = as_type<uchar4>(w[i]);
ushort4 q = ((const device ushort4*)wq)[i];
ushort4 lo = q & ushort4(0x000f);
ushort4 hi = (q & 0x00f0) >> 4;
float4 f = float4(h.wzyx) * 2.0f + float4(u);
f.xy = f.yx;
float2 s = f.zw + float2(lo.xy) - float2(hi.zw);
char4 c = char4(int4(u) - 128);
((device float4*)out)[i] = float4(f.xy, s);
((device float4*)out)[i + uint(x_shape[0]) / 4] = float4(c) + float4(lo.zw, hi.xy).wzyx;
"""

STRIDED = """
uint i = thread_position_in_grid.x;
out[i] = x[elem_to_loc(i, x_shape, x_strides, x_ndim)] * 2.0f;
"""

HISTOGRAM = """
uint i = thread_position_in_grid.x;
atomic_fetch_add_explicit(&hist[uint(x[i]) % 8], 1, memory_order_relaxed);
"""

SIMD_OPS = """
uint i = thread_position_in_grid.x;
uint lane = thread_index_in_simdgroup;
float v = x[i];
float r = v;
for (ushort o = 16; o > 0; o /= 2) {
  r += simd_shuffle_down(r, o);
}
float q = quad_sum(v);
out[i * 7 + 0] = simd_prefix_exclusive_sum(v);
out[i * 7 + 1] = simd_prefix_inclusive_sum(v);
out[i * 7 + 2] = simd_broadcast(v, 3);
out[i * 7 + 3] = simd_shuffle_xor(v, 1);
out[i * 7 + 4] = simd_max(v);
out[i * 7 + 5] = lane == 0 ? r : q;
out[i * 7 + 6] = simd_shuffle(v, (lane + 5) % 32) + simd_shuffle_up(v, 2);
"""

BFLOAT = """
uint i = thread_position_in_grid.x;
float v = float(x[i]);
y[i] = v * 2.0f + 1.0f;
z[i] = bfloat16_t(v * 3.0f);
"""

GRID2D = """
uint2 p = thread_position_in_grid.xy;
uint w = threads_per_grid.x;
pos[p.y * w + p.x] = p.x * 100 + p.y;
grp[p.y * w + p.x] = threadgroup_position_in_grid.x + 10 * threadgroup_position_in_grid.y
                     + 1000 * thread_position_in_threadgroup.x;
"""


def _f32(a):
    return np.array(a.astype(mx.float32))


@dataclasses.dataclass
class Good:
    id: str
    kernel: dict
    run: Callable  # (kernel) -> (outputs, expected list, tolerance)


def _rowsum(T, rows, n, tg):
    def run(k):
        x = mx.random.normal((rows, n), key=mx.random.key(1)).astype(T)
        out = k(inputs=[x], template=[("T", T)], grid=(rows * tg, 1, 1), threadgroup=(tg, 1, 1),
                output_shapes=[(rows,)], output_dtypes=[T])
        return out, [_f32(x).sum(1)], 2e-2 if T == mx.float16 else 1e-4
    return run


def _matmul(T, M, N, K, trans_b):
    def run(k):
        a = mx.random.normal((M, K), key=mx.random.key(2)).astype(T)
        b = mx.random.normal((K, N), key=mx.random.key(3)).astype(T)
        bin_ = b.T if trans_b else b
        out = k(inputs=[a, mx.contiguous(bin_)], template=[("T", T), ("K", K), ("N", N), ("TRANS_B", trans_b)],
                grid=(32 * (M // 8) * (N // 8), 1, 1), threadgroup=(32 * (M // 8) * (N // 8), 1, 1),
                output_shapes=[(M, N)], output_dtypes=[mx.float32])
        return out, [_f32(a) @ _f32(b)], 1e-3
    return run


def _fragment(k):
    inp = mx.arange(64, dtype=mx.float32)
    out = k(inputs=[inp], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(64,)],
            output_dtypes=[mx.float32])
    # Apple's lane layout of an 8x8 simdgroup matrix, as MLX (steel/gemm/mma.h, get_coord) and tinygrad
    # (runtime/ops_python.py, Metal WMMA) rely on: lane l holds row ((l/4)&4) + (l/2)%4, columns
    # ((l/4)&2)*2 + (l%2)*2 + {0, 1}.
    exp = np.zeros(64, np.float32)
    for lane in range(32):
        row = ((lane // 4) & 4) + (lane // 2) % 4
        col = ((lane // 4) & 2) * 2 + (lane % 2) * 2
        exp[2 * lane], exp[2 * lane + 1] = row * 8 + col, row * 8 + col + 1
    assert sorted(exp) == list(range(64))  # every element held by exactly one lane
    return out, [exp], 0


def _vec_elementwise(k):
    n = 64
    rng = np.random.default_rng(4)
    x = rng.standard_normal(n).astype(np.float16)
    w = rng.integers(0, 2**32, n // 4, dtype=np.uint32)
    wq = rng.integers(0, 2**16, n, dtype=np.uint16)
    out = k(inputs=[mx.array(x), mx.array(w), mx.array(wq)], grid=(n // 4 + 3, 1, 1), threadgroup=(32, 1, 1),
            output_shapes=[(2 * n,)], output_dtypes=[mx.float32])
    h = x.reshape(-1, 4).astype(np.float32)
    u = w.view(np.uint8).reshape(-1, 4).astype(np.float32)
    q = wq.reshape(-1, 4)
    lo, hi = (q & 0xF).astype(np.float32), ((q & 0xF0) >> 4).astype(np.float32)
    f = h[:, ::-1] * 2 + u
    f[:, [0, 1]] = f[:, [1, 0]]
    s = f[:, 2:] + lo[:, :2] - hi[:, 2:]
    first = np.concatenate([f[:, :2], s], 1)
    c = (u - 128).astype(np.int8).astype(np.float32)
    second = c + np.concatenate([lo[:, 2:], hi[:, :2]], 1)[:, ::-1]
    return out, [np.concatenate([first.reshape(-1), second.reshape(-1)])], 1e-3


def _strided(k):
    base = mx.arange(6 * 10, dtype=mx.float32).reshape(6, 10)
    x = base[1:5, 2:9].T  # shape (7, 4), strides (1, 10)
    out = k(inputs=[x], grid=(28, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(7, 4)],
            output_dtypes=[mx.float32])
    return out, [np.array(x) * 2], 0


def _histogram(k):
    x = mx.array(np.arange(100, dtype=np.float32) * 3)
    out = k(inputs=[x], grid=(100, 1, 1), threadgroup=(64, 1, 1), output_shapes=[(8,)], output_dtypes=[mx.int32],
            init_value=0)
    return out, [np.bincount((np.arange(100) * 3) % 8, minlength=8)], 0


def _simd_ops(k):
    x = np.random.default_rng(5).integers(-8, 9, 64).astype(np.float32)
    out = k(inputs=[mx.array(x)], grid=(64, 1, 1), threadgroup=(64, 1, 1), output_shapes=[(64, 7)],
            output_dtypes=[mx.float32])
    e = np.zeros((64, 7), np.float32)
    for base in (0, 32):
        v = x[base:base + 32]
        lanes = np.arange(32)
        e[base:base + 32, 0] = np.cumsum(v) - v
        e[base:base + 32, 1] = np.cumsum(v)
        e[base:base + 32, 2] = v[3]
        e[base:base + 32, 3] = v[lanes ^ 1]
        e[base:base + 32, 4] = v.max()
        e[base:base + 32, 5] = np.repeat(v.reshape(8, 4).sum(1), 4)
        e[base, 5] = v.sum()
        e[base:base + 32, 6] = v[(lanes + 5) % 32] + np.where(lanes >= 2, v[lanes - 2], v)
    return out, [e], 0


def _bfloat(k):
    x = mx.random.normal((40,), key=mx.random.key(6)).astype(mx.bfloat16)
    out = k(inputs=[x], grid=(40, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(40,), (40,)],
            output_dtypes=[mx.float32, mx.bfloat16])
    return out, [_f32(x) * 2 + 1, _f32((x.astype(mx.float32) * 3).astype(mx.bfloat16))], 0


def _grid2d(k):
    out = k(inputs=[], grid=(37, 5, 1), threadgroup=(16, 4, 1), output_shapes=[(5, 37), (5, 37)],
            output_dtypes=[mx.uint32, mx.uint32])
    y, x = np.mgrid[0:5, 0:37]
    return out, [x * 100 + y, x // 16 + 10 * (y // 4) + 1000 * (x % 16)], 0


def K(name, inputs, outputs, source, **kw):
    return dict(name=name, input_names=inputs, output_names=outputs, source=source, **kw)


GOOD = [
    Good("rowsum-simd_sum-threadgroup-fp16", K("rowsum", ["inp"], ["out"], ROWSUM), _rowsum(mx.float16, 5, 1000, 256)),
    Good("rowsum-partial-simdgroups-fp32", K("rowsum", ["inp"], ["out"], ROWSUM), _rowsum(mx.float32, 3, 37, 96)),
    Good("simdgroup-matmul-float", K("mm", ["A", "B"], ["C"], MATMUL), _matmul(mx.float32, 16, 16, 24, False)),
    Good("simdgroup-matmul-half-transposed-B", K("mm", ["A", "B"], ["C"], MATMUL),
         _matmul(mx.float16, 8, 24, 16, True)),
    Good("simdgroup-fragment-layout", K("frag", ["inp"], ["out"], FRAGMENT), _fragment),
    Good("vector-elementwise-half4-uchar4-ushort4-swizzles", K("vec", ["x", "w", "wq"], ["out"], VEC_ELEMENTWISE),
         _vec_elementwise),
    Good("strided-input-elem_to_loc", K("strided", ["x"], ["out"], STRIDED, ensure_row_contiguous=False), _strided),
    Good("atomic-histogram", K("hist", ["x"], ["hist"], HISTOGRAM, atomic_outputs=True), _histogram),
    Good("simd-shuffles-prefix-quad", K("simdops", ["x"], ["out"], SIMD_OPS), _simd_ops),
    Good("bfloat-in-out", K("bf", ["x"], ["y", "z"], BFLOAT), _bfloat),
    Good("grid-2d-partial-threadgroups", K("grid2d", [], ["pos", "grp"], GRID2D), _grid2d),
]


@pytest.mark.metal
@pytest.mark.parametrize("case", GOOD, ids=[c.id for c in GOOD])
def test_good_kernel_matches_numpy(case, metal_kernel_factory):
    k = metal_kernel_factory(**case.kernel)
    outs, expected, tol = case.run(k)
    assert len(outs) == len(expected)
    for o, e in zip(outs, expected):
        got = _f32(o) if o.dtype in (mx.float16, mx.bfloat16) else np.array(o)
        assert got.shape == np.shape(e)
        np.testing.assert_allclose(got, e, rtol=tol, atol=tol)


# ------------------------------------------------------------------------------------------ bad kernels
@dataclasses.dataclass
class Bad:
    id: str
    kernel: dict
    call: dict
    error: tuple  # the KernelError subclass(es) of the check meant to catch it


def _x(n=256, dtype=mx.float32):
    return mx.arange(n, dtype=dtype)


def _call(inputs, n_out, grid, tg, dtype=mx.float32, **kw):
    return dict(inputs=inputs, grid=grid, threadgroup=tg, output_shapes=[(n_out,)], output_dtypes=[dtype], **kw)


BAD = [
    Bad("missing-barrier",
        K("nobarrier", ["x"], ["out"], """
uint t = thread_index_in_threadgroup;
threadgroup float buf[128];
buf[t] = x[thread_position_in_grid.x];
// missing threadgroup_barrier(mem_flags::mem_threadgroup);
out[thread_position_in_grid.x] = buf[127 - t];
"""), _call([_x()], 256, (256, 1, 1), (128, 1, 1)),
        (metal_emu.UninitializedThreadgroupRead, metal_emu.OrderDependence)),
    Bad("divergent-simd_sum",
        K("divsum", ["x"], ["out"], """
uint i = thread_position_in_grid.x;
float v = x[i];
if (thread_index_in_simdgroup % 2 == 0) {
  v = simd_sum(v);
}
out[i] = v;
"""), _call([_x()], 256, (256, 1, 1), (64, 1, 1)), (metal_emu.DivergentCollective,)),
    Bad("simd_sum-after-early-return",
        K("retsum", ["x"], ["out"], """
uint i = thread_position_in_grid.x;
if (i >= 200) {
  return;
}
out[i] = simd_sum(x[i]);
"""), _call([_x()], 256, (256, 1, 1), (64, 1, 1), init_value=0), (metal_emu.DivergentCollective,)),
    Bad("out-of-bounds-read",
        K("oobread", ["x"], ["out"], """
uint i = thread_position_in_grid.x;
out[i] = x[i] + x[i + 1];  // reads x[n] in the last thread
"""), _call([_x(100)], 100, (100, 1, 1), (32, 1, 1)), (metal_emu.OutOfBounds,)),
    Bad("out-of-bounds-read-before-start",
        K("oobneg", ["x"], ["out"], """
int i = int(thread_position_in_grid.x);
out[i] = x[i - 1];  // reads x[-1] in the first thread
"""), _call([_x(100)], 100, (100, 1, 1), (32, 1, 1)), (metal_emu.OutOfBounds,)),
    Bad("out-of-bounds-write",
        K("oobwrite", ["x"], ["out"], """
uint i = thread_position_in_grid.x;
out[i + 1] = x[i];
"""), _call([_x(100)], 100, (100, 1, 1), (32, 1, 1)), (metal_emu.OutOfBounds,)),
    Bad("threadgroup-array-out-of-bounds",
        K("tgoob", ["x"], ["out"], """
uint t = thread_index_in_threadgroup;
threadgroup float buf[64];
buf[t] = x[t];
threadgroup_barrier(mem_flags::mem_threadgroup);
out[t] = buf[t] + buf[t + 1];  // buf[64] in the last thread
"""), _call([_x(64)], 64, (64, 1, 1), (64, 1, 1)), (metal_emu.OutOfBounds,)),
    Bad("threadgroup-array-underflow",
        K("tgneg", ["x"], ["out"], """
int t = int(thread_index_in_threadgroup);
threadgroup float buf[64];
buf[t] = x[t];
threadgroup_barrier(mem_flags::mem_threadgroup);
out[t] = buf[t] - buf[t - 1];  // buf[-1] in the first thread
"""), _call([_x(64)], 64, (64, 1, 1), (64, 1, 1)), (metal_emu.OutOfBounds,)),
    Bad("oversized-threadgroup-array-static",
        K("bigtg", ["x"], ["out"], """
threadgroup float big[9000];
uint t = thread_index_in_threadgroup;
big[t] = x[t];
threadgroup_barrier(mem_flags::mem_threadgroup);
out[t] = big[(t + 1) % 32];
"""), _call([_x(32)], 32, (32, 1, 1), (32, 1, 1)), (metal_emu.ThreadgroupMemoryLimit,)),
    Bad("oversized-threadgroup-array-templated",
        K("bigtgt", ["x"], ["out"], """
threadgroup float a[SIZE];
threadgroup float b[SIZE];
uint t = thread_index_in_threadgroup;
a[t] = x[t];
b[t] = x[t];
threadgroup_barrier(mem_flags::mem_threadgroup);
out[t] = a[(t + 1) % 32] + b[t];
"""), _call([_x(32)], 32, (32, 1, 1), (32, 1, 1), template=[("SIZE", 4500)]), (metal_emu.ThreadgroupMemoryLimit,)),
    Bad("early-return-before-barrier",
        K("earlyret", ["x"], ["out"], """
uint t = thread_index_in_threadgroup;
threadgroup float buf[128];
if (t >= 100) {
  return;
}
buf[t] = x[t];
threadgroup_barrier(mem_flags::mem_threadgroup);
out[t] = buf[99 - t];
"""), _call([_x(128)], 128, (128, 1, 1), (128, 1, 1), init_value=0), (metal_emu.EarlyReturnBeforeBarrier,)),
    Bad("barrier-in-divergent-branches",
        K("divbar", ["x"], ["out"], """
uint t = thread_index_in_threadgroup;
threadgroup float buf[64];
buf[t] = x[t];
if (t < 32) {
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[t] = buf[63 - t];
} else {
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[t] = buf[t];
}
"""), _call([_x(64)], 64, (64, 1, 1), (64, 1, 1)), (metal_emu.DivergentBarrier,)),
    Bad("uninitialised-threadgroup-read",
        K("uninit", ["x"], ["out"], """
uint lane = thread_index_in_simdgroup;
uint sg = simdgroup_index_in_threadgroup;
threadgroup float partial[32];
float s = simd_sum(x[thread_position_in_grid.x]);
if (lane == 0) {
  partial[sg] = s;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
if (sg == 0) {
  float v = simd_sum(partial[lane]);  // only simdgroups_per_threadgroup slots were written
  if (lane == 0) {
    out[threadgroup_position_in_grid.x] = v;
  }
}
"""), _call([_x(128)], 2, (128, 1, 1), (64, 1, 1), init_value=0), (metal_emu.UninitializedThreadgroupRead,)),
    Bad("shuffle-from-missing-lane",
        K("shufmiss", ["x"], ["out"], """
uint i = thread_position_in_grid.x;
out[i] = simd_shuffle_down(x[i], 16);  // the second SIMD-group has 16 lanes: lane 0 reads lane 16
"""), _call([_x(48)], 48, (48, 1, 1), (48, 1, 1)), (metal_emu.UninitializedThreadgroupRead,)),
    Bad("unwritten-output",
        K("halfout", ["x"], ["out"], """
uint i = thread_position_in_grid.x;
if (i < 50) {
  out[i] = x[i];
}
"""), _call([_x(100)], 100, (100, 1, 1), (32, 1, 1)), (metal_emu.UnwrittenOutput,)),
    Bad("dependence-between-threadgroups",
        K("chain", ["x"], ["out"], """
uint g = threadgroup_position_in_grid.x;
if (thread_index_in_threadgroup == 0) {
  out[g] = g == 0 ? x[0] : out[g - 1] + 1.0f;
}
"""), _call([_x(32)], 8, (256, 1, 1), (32, 1, 1)), (metal_emu.OrderDependence,)),
    Bad("double-is-not-metal",
        K("dbl", ["x"], ["out"], """
uint i = thread_position_in_grid.x;
double d = x[i];
out[i] = float(d);
"""), _call([_x(32)], 32, (32, 1, 1), (32, 1, 1)), (metal_emu.LintError,)),
    Bad("recursion-in-header",
        K("rec", ["x"], ["out"], """
out[thread_position_in_grid.x] = fact(x[thread_position_in_grid.x]);
""", header="inline float fact(float v) { return v <= 1.0f ? 1.0f : v * fact(v - 1.0f); }\n"),
        _call([_x(32)], 32, (32, 1, 1), (32, 1, 1)), (metal_emu.LintError,)),
    Bad("warning-is-an-error",
        K("warn", ["x"], ["out"], """
uint i = thread_position_in_grid.x;
float unused = 1.0f;
out[i] = x[i] * 0.5;  // float promoted to double
"""), _call([_x(32)], 32, (32, 1, 1), (32, 1, 1)), (metal_emu.StrictCompileError,)),
    Bad("float64-input",
        K("f64", ["x"], ["out"], "out[thread_position_in_grid.x] = float(x[thread_position_in_grid.x]);"),
        _call([mx.arange(32, dtype=mx.float64, stream=mx.cpu)], 32, (32, 1, 1), (32, 1, 1)), (metal_emu.CallError,)),
    Bad("threadgroup-too-large",
        K("bigtgsize", ["x"], ["out"], "out[thread_position_in_grid.x] = x[thread_position_in_grid.x];"),
        _call([_x(4096)], 4096, (4096, 1, 1), (2048, 1, 1)), (metal_emu.ThreadgroupSize,)),
]


@pytest.mark.parametrize("case", BAD, ids=[c.id for c in BAD])
@emulator_only
def test_bad_kernel_is_caught(case):
    k = metal_emu.metal_kernel(**case.kernel)
    with pytest.raises(case.error) as ei:
        k(**case.call)
    assert f"[metal_emu:{ei.value.check}]" in str(ei.value)


@emulator_only
def test_spin_wait_between_threadgroups_times_out(monkeypatch):
    monkeypatch.setattr(metal_emu.config, "timeout", 1)
    k = metal_emu.metal_kernel(name="spin", input_names=["x"], output_names=["flag"], atomic_outputs=True, source="""
uint g = threadgroup_position_in_grid.x;
if (g == 1) {
  atomic_store_explicit(&flag[0], 1, memory_order_relaxed);
}
while (g == 0 && atomic_load_explicit(&flag[0], memory_order_relaxed) == 0) {
}
""")
    with pytest.raises(metal_emu.Timeout, match=r"\[metal_emu:timeout\]"):
        k(inputs=[_x(8)], grid=(64, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(1,)], output_dtypes=[mx.int32],
          init_value=0)


@emulator_only
def test_all_schedules_mode_accepts_correct_and_rejects_racy_kernels(monkeypatch):
    # METAL_EMU_SCHEDULES=all adds shuffled threadgroup and lane orders: a correct kernel must give the same
    # bits under all of them, a kernel with a missing barrier must still be rejected.
    monkeypatch.setattr(metal_emu.config, "schedules", "all")
    k = metal_emu.metal_kernel(**GOOD[0].kernel)
    out, expected, tol = GOOD[0].run(k)
    np.testing.assert_allclose(_f32(out[0]), expected[0], rtol=tol, atol=tol)
    bad = metal_emu.metal_kernel(**BAD[0].kernel)
    with pytest.raises((metal_emu.UninitializedThreadgroupRead, metal_emu.OrderDependence)):
        bad(**BAD[0].call)


# ------------------------------------------------------------------------------------------ signature rules
SIGNATURE_CASES = [
    dict(names=["inp", "n"], source="out[0] = inp[0] + n + inp_shape[0]; // thread_position_in_grid",
         inputs=[mx.zeros((64,), mx.float16), mx.array(3)], template=[("T", mx.float16), ("B", 4), ("F", True)],
         atomic=False, out=mx.float16),
    dict(names=["inp", "small"], source="out[0] = inp[elem_to_loc(0, inp_shape, inp_strides, inp_ndim)] + small[0];"
         " simdgroup_index_in_threadgroup; thread_index_in_simdgroup; threads_per_threadgroup; grid_size",
         inputs=[mx.zeros((8, 8), mx.bfloat16), mx.zeros((3,), mx.uint8)], template=None, atomic=True,
         out=mx.float32),
    dict(names=["a"], source="out[0] = a[0]; // quadgroup_index_in_threadgroup dispatch_threads_per_threadgroup",
         inputs=[mx.zeros((7,), mx.int64)], template=[("U", mx.uint32)], atomic=False, out=mx.int32),
]


@emulator_only
@pytest.mark.parametrize("case", SIGNATURE_CASES, ids=["template-0d-shape", "strides-atomic-constant", "attrs"])
def test_generated_signature_matches_mlx_capture(case):
    spec = dict(name="sig", input_names=case["names"], output_names=["out"], source=case["source"],
                header="// header\n", ensure_row_contiguous=True, atomic_outputs=case["atomic"])
    captured = metal_emu.capture_source(spec, case["inputs"], [(4,)], [case["out"]], (32, 1, 1), (32, 1, 1),
                                        case["template"], 0.0 if case["atomic"] else None)
    assert captured is not None, "MLX did not print the generated source under mx.export_function"
    _, generated = metal_emu.generate_source("sig", case["names"], ["out"], case["source"], "// header\n",
                                             case["inputs"], [case["out"]], case["template"], case["atomic"])
    assert generated == captured


@emulator_only
def test_compile_strict_api_reports_lint_and_passes_clean_source():
    src = metal_emu.compile_strict(name="ok", input_names=["x"], output_names=["y"],
                                   source="y[thread_position_in_grid.x] = x[thread_position_in_grid.x] * 2.0f;",
                                   inputs=[mx.zeros((16,))], output_dtypes=[mx.float32])
    assert "[[kernel]] void custom_kernel_ok" in src
    with pytest.raises(metal_emu.LintError, match="std::"):
        metal_emu.compile_strict(name="bad", input_names=["x"], output_names=["y"],
                                 source="y[0] = std::max(x[0], 0.0f);", inputs=[mx.zeros((16,))],
                                 output_dtypes=[mx.float32])


def test_fixture_installs_factory_into_package(metal_kernel_factory, metal_backend):
    from mlx_fastops import kernels

    assert kernels._factories["metal"] is metal_kernel_factory
    if metal_backend == "emulator":
        assert metal_kernel_factory is metal_emu.metal_kernel
