"""The CUDA emulator (tests/cuda_emu) itself: it must run correct kernels like a GPU and refuse
broken ones. A table of tiny kernels, one call each."""

import mlx.core as mx
import numpy as np
import pytest

import cuda_emu

REDUCE = """
int i = threadIdx.x;
float v = static_cast<float>(x[blockIdx.x * blockDim.x + i]);
for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
__shared__ float part[4];
if ((i & 31) == 0) part[i >> 5] = v;
__syncthreads();
if (i == 0) y[blockIdx.x] = part[0] + part[1] + part[2] + part[3];
"""


def run(src, inputs, shape, dtype=mx.float32, grid=(128, 1, 1), tg=(128, 1, 1), contiguous=True, names=("x",)):
    k = cuda_emu.cuda_kernel(name="t", input_names=list(names), output_names=["y"], source=src,
                             ensure_row_contiguous=contiguous)
    return k(inputs=inputs, output_shapes=[shape], output_dtypes=[dtype], grid=grid, threadgroup=tg)[0]


def test_block_reduction_with_shuffles_and_barrier():
    x = mx.random.normal((3 * 128,)).astype(mx.bfloat16)
    y = run(REDUCE, [x], (3,), grid=(3 * 128, 1, 1))
    ref = x.astype(mx.float32).reshape(3, 128).sum(-1)
    assert np.allclose(np.asarray(y), np.asarray(ref), rtol=1e-5, atol=1e-4)


def test_bfloat16_and_half_rounding_match_mlx():
    x = mx.random.normal((256,)) * 100
    src = "int i = threadIdx.x + blockIdx.x * blockDim.x; y[i] = static_cast<T>(x[i] * 1.0f);"
    for dt, name in ((mx.bfloat16, "__nv_bfloat16"), (mx.float16, "__half")):
        y = run(f"using T = {name};\n" + src, [x], (256,), dtype=dt, grid=(256, 1, 1))
        assert mx.array_equal(y, x.astype(dt))


def test_byte_perm_unpacks_nibbles_like_the_gemv():
    src = """int i = threadIdx.x;
    unsigned w = x[0], lo = w & 0x0F0F0F0Fu, hi = (w >> 4) & 0x0F0F0F0Fu;
    if (i < 4) y[2 * i] = __int_as_float(__byte_perm(lo, 0x4B000000u, 0x7540 + i)) - 8388608.f;
    if (i < 4) y[2 * i + 1] = __int_as_float(__byte_perm(hi, 0x4B000000u, 0x7540 + i)) - 8388608.f;"""
    w = 0x8A3F15C7
    y = run(src, [mx.array([w], dtype=mx.uint32)], (8,), grid=(32, 1, 1), tg=(32, 1, 1))
    assert np.asarray(y).tolist() == [float((w >> (4 * j)) & 0xF) for j in range(8)]


def test_folded_nibbles_are_half_plus_q_over_32():
    # gemv.cu's FOLD4: nibbles shifted to bits 3-6 of each byte, permuted under exponent 126
    src = """int i = threadIdx.x;
    unsigned w = x[0], lo = (w << 3) & 0x78787878u, hi = (w >> 1) & 0x78787878u;
    if (i < 4) y[2 * i] = __int_as_float(__byte_perm(lo, 0x3F000000u, 0x7044 + (i << 8)));
    if (i < 4) y[2 * i + 1] = __int_as_float(__byte_perm(hi, 0x3F000000u, 0x7044 + (i << 8)));"""
    w = 0x8A3F15C7
    y = run(src, [mx.array([w], dtype=mx.uint32)], (8,), grid=(32, 1, 1), tg=(32, 1, 1))
    assert np.asarray(y).tolist() == [0.5 + ((w >> (4 * j)) & 0xF) / 32 for j in range(8)]


def test_in_place_write_to_a_strided_input_reaches_the_array():
    big = mx.zeros((2, 8, 4))
    view = big[:, 2:6]                     # strided: rows 2..5 of each batch
    src = """int b = threadIdx.x;
    const_cast<float*>(x)[b * x_strides[0] + 1 * x_strides[1] + 3] = 7.f;
    y[b] = 1.f;"""
    run(src, [view], (2,), grid=(2, 1, 1), tg=(2, 1, 1), contiguous=False)
    assert np.asarray(big)[:, 3, 3].tolist() == [7.0, 7.0] and float(mx.sum(big)) == 14.0


BROKEN = [
    # a lane that left the loop is still named in the shuffle's mask
    ("""int i = threadIdx.x; float v = 1.f;
        for (int k = 0; k < (i < 16 ? 1 : 2); ++k) v += __shfl_xor_sync(0xffffffffu, v, 1);
        y[i] = v;""", "deadlock"),
    # the source lane is outside the mask
    ("""int i = threadIdx.x; float v = __shfl_xor_sync(0x0000ffffu, 1.f, 16); y[i] = v;""", "outside its mask"),
    # lane 0 waits at a barrier while the rest of its warp waits for it at a shuffle
    ("""int i = threadIdx.x; if (i == 0) __syncthreads(); else y[i] = __shfl_xor_sync(0xffffffffu, 1.f, 1);""",
     "deadlock"),
]


@pytest.mark.parametrize("src,message", BROKEN)
def test_broken_kernels_are_refused(src, message):
    with pytest.raises(cuda_emu.KernelError, match=message):
        run(src, [mx.zeros((1,))], (128,))


def test_unwritten_outputs_are_poisoned():
    y = run("if (threadIdx.x < 64) y[threadIdx.x] = 1.f;", [mx.zeros((1,))], (128,))
    y = np.asarray(y)
    assert (y[:64] == 1).all() and np.isnan(y[64:]).all()


def test_shared_memory_is_poisoned_between_blocks():
    # block 0 writes s before reading it; block 1 forgets to: it must not see block 0's value
    src = """__shared__ float s[32];
    if (blockIdx.x == 0) s[threadIdx.x] = 1.f;
    __syncthreads();
    y[blockIdx.x * 32 + threadIdx.x] = s[threadIdx.x];"""
    y = np.asarray(run(src, [mx.zeros((1,))], (64,), grid=(64, 1, 1), tg=(32, 1, 1)))
    assert (y[:32] == 1).all() and np.isnan(y[32:]).all()


def test_dynamic_shared_memory_is_one_buffer_of_the_kernels_size():
    # every `extern __shared__` declaration names the same bytes (as in CUDA), poisoned per block
    src = """extern __shared__ float4 a[];
    extern __shared__ float b[];
    if (blockIdx.x == 0) b[threadIdx.x] = threadIdx.x;
    __syncthreads();
    y[blockIdx.x * 32 + threadIdx.x] = reinterpret_cast<float*>(a)[threadIdx.x];"""
    k = cuda_emu.cuda_kernel(name="t", input_names=["x"], output_names=["y"], source=src, shared_memory=128)
    y = np.asarray(k(inputs=[mx.zeros((1,))], output_shapes=[(64,)], output_dtypes=[mx.float32], grid=(64, 1, 1),
                     threadgroup=(32, 1, 1))[0])
    assert (y[:32] == np.arange(32)).all() and np.isnan(y[32:]).all()


TWO_GROUPS = """
int b = blockIdx.x, t = threadIdx.x;
int* c = const_cast<int*>(ctr);
if (b < 8) {                          // group A: a[b*32 + t] = b
  for (int i = 0; i < 50; ++i) __syncthreads();   // some work
  a[b * 32 + t] = (float)b;
  __syncthreads();
  if (t == 0) atomicAdd(c, 1);
} else {                              // group B: sums all of a
  if (WAIT) {
    if (t == 0) while (atomicAdd(c, 0) < 8) __nanosleep(100);
    __syncthreads();
  }
  float s = 0.f;
  for (int i = 0; i < 256; ++i) s += a[i];
  y[(b - 8) * 32 + t] = s;
}
"""


@pytest.mark.parametrize("wait", [True, False])
def test_interleaved_blocks_expose_a_missing_wait(wait):
    """Blocks of a later group that do not wait for an earlier group read its unwritten (poisoned)
    output; with the wait they read the finished values."""
    k = cuda_emu.cuda_kernel(name="t", input_names=["ctr"], output_names=["y", "a"],
                             source=f"#define WAIT {int(wait)}\n" + TWO_GROUPS)
    y, _ = k(inputs=[mx.zeros((4,), dtype=mx.int32)], output_shapes=[(256,), (256,)],
             output_dtypes=[mx.float32, mx.float32], grid=(16 * 32, 1, 1), threadgroup=(32, 1, 1))
    y = np.asarray(y)
    if wait:
        assert (y == sum(range(8)) * 32).all()
    else:
        assert np.isnan(y).any()
