"""CUDA backend: thin wrappers around the kernels in cuda/*.cu (mx.fast.cuda_kernel).

Ops (same signatures as backends/reference.py):
  qkv_proj, gate_up_silu, lm_head   quantised GEMV (cuda/gemv.cu) for 1-8 activation rows; more
                                    rows (prefill) go to the reference (stock quantized_matmul)
  decode_attention                  GQA decode attention over the full cache buffers (attention.cu)
Ops without a CUDA kernel (rms_norm_residual, qk_norm_rope, flash_attention) use the reference.

Fast decode path (`fast_block`): a whole decoder block in one launch (the 5 kernels below as 5
block groups, each waiting for the previous; consecutive layers of up to GROUP_MAX_WEIGHTS in one launch)
or (layer_kernel disabled) in 5 launches, when the layer's cache is a `StaticKVCache` and B*L <= 8:
  1. input RMSNorm + QKV GEMV + q/k RMSNorm + RoPE + k/v written into the cache in place
  2. attention over the cache buffers (split over the sequence, merged in the same launch)
  3. o_proj GEMV + residual add
  4. post-attention RMSNorm + gate/up GEMV + SiLU*up
  5. down GEMV + residual add
The one-launch layer's variants each have a kill switch (config.FUSIONS): its GEMV phases start
their weights before they wait (layer_prefetch), waits poll with loads (layer_wait_load),
attention blocks take 2 query heads (attn_head_split), GEMV phases take 2-4 rows per warp where
that keeps them in one wave of blocks (layer_one_wave), GEMV phases of more row groups than a
wave launch one wave whose blocks run several groups in turn (layer_stream), attention blocks send
their chunk's K/V rows to L2 before they wait for q (attn_prefetch), and the compiled step puts
consecutive layers in one launch (layer_groups), each phase with one call site whose block picks
its layer's inputs (layer_loop; off: one call site per layer and phase, up to 4 layers). Every
GEMV turns 4-bit weights into floats by one byte permute (nibble_fold) and, where x fits, converts
(and normalizes) x once per block into shared memory (x_stage).
Kernel sources reach MLX with the conditionals their defines decide cut down and without comments
(kernels.resolve_conditionals, compact_source): MLX hashes the whole source at every launch.
Kernel objects are built lazily, once per (kernel, static shape class); model constants (norm
eps, RoPE base) are #defines; per-step values (the cache offset) are int32 arrays of 16 bytes; the
cache buffers are read and written through their strides. Without a GPU the same wrappers run
through the CPU emulator of tests/cuda_emu (`kernels.use_cuda_factory`).
"""

import hashlib
import math

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import cache as _mlx_lm_cache
from mlx_lm.models.cache import KVCache

from .. import config
from ..kernels import cached_builder, cuda_kernel, read_source, resolve_conditionals

_CTYPE = {mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.float32: "float"}
_HALF = (mx.float16, mx.bfloat16)
MAX_ROWS = 8
MAX_GQA = 8    # query heads per kv head held in registers by the attention kernel
LOG2E = 1.4426950408889634


# A kernel in a launch of its own finds its block through blockIdx/gridDim.
STANDALONE = dict(BLOCK_X="blockIdx.x", BLOCK_Y="blockIdx.y", BLOCK_Z="blockIdx.z", GRID_X="gridDim.x")


def source(filename, defines, dtype):
    """Kernel body: #defines for the static shape class, the T alias, then the file's body."""
    defines = {**STANDALONE, **defines}
    lines = [f"#define {k} {int(v) if isinstance(v, bool) else v}" for k, v in defines.items()]
    lines.append(f"using T = {_CTYPE[dtype]};")
    return "\n".join(lines) + "\n" + resolve_conditionals(read_source("cuda", filename), defines)


def _name(kind, src):
    """Kernel names unique per source: MLX may key its JIT module cache on the name."""
    return f"fastops_{kind}_{hashlib.sha1(src.encode()).hexdigest()[:12]}"


# ---------------------------------------------------------------------------------------------
# GEMV
# ---------------------------------------------------------------------------------------------

# Blocks of 128 threads resident at once on the H200 (132 SMs, 4 blocks each at <= 128 registers).
RESIDENT_BLOCKS = 4 * 132
ONE_WAVE_MIN_K = 2048   # layer_one_wave: rows at least this long (shorter ones: a second wave is cheap)


def lane_elems(bits, vec):
    """EPW of gemv.cu: the k a lane covers per step (VEC uint32 words of 8 nibbles or 4 bytes)."""
    return (8 if bits == 4 else 4) * vec


def gemv_config(M, K, N, bits, epi, one_wave=False):
    """(VEC, R, NW): uint32 words per lane load, rows per warp, warps per block.

    Decode GEMVs are latency-bound: few rows per warp and small blocks give many short, parallel
    chains. Two rows per warp only where there are rows to spare (and always for the head kernel,
    whose blocks must tile a head), and (one_wave: layer_one_wave) 2 or 4 where fewer would leave a
    second wave of blocks with long rows (K >= ONE_WAVE_MIN_K) to run after the first: Qwen3-4B
    o_proj/down 640 -> 320 blocks, Qwen3-4B/8B QKV 768 -> 384. At most 4 weight rows per warp
    (gate/up: 2 gate + 2 up), as many as gate/up already holds."""
    VEC = 4 if M == 1 else (2 if M == 2 else 1)
    while VEC > 1 and K % lane_elems(bits, VEC):
        VEC //= 2
    nout = N // 2 if epi == 2 else N
    R = 2 if (epi == 3 or nout >= 4096) else 1
    rmax = 2 if epi == 2 else 4
    while one_wave and R < rmax and K >= ONE_WAVE_MIN_K and gemv_blocks(N, epi, R, 4) > RESIDENT_BLOCKS:
        R *= 2   # the head kernel's blocks still tile a head: 4 warps x 4 rows divide D = 64/128/256
    return VEC, R, 4


# A GEMV stages x as floats in shared memory (gemv.cu, XK) up to this many (16 KB per block; the
# staging registers hold 32 elements per thread): Qwen3-8B's hidden size at batch 1, Qwen3-0.6B's
# up to 4 rows.
STAGE_MAX_FLOATS = 4096


def stream_blocks(nb):
    """layer_stream: blocks launched for a GEMV phase of nb row groups (one per block otherwise),
    each running ceil(nb / blocks) of them in turn (gemv.cu, STREAM): one wave of equal shares
    where nb would leave later waves (Qwen3-8B gate/up 1536 -> 512 blocks of 3, 4B 1216 -> 406)."""
    if nb <= RESIDENT_BLOCKS:
        return nb
    per = -(-nb // RESIDENT_BLOCKS)
    return -(-nb // per)


def x_stage(M, K, dtype, on=True):
    """XK of gemv.cu: K when a GEMV stages its x (x_stage; half types), else 0."""
    return K if on and dtype in _HALF and M * K <= STAGE_MAX_FLOATS else 0


def x_stage_bytes(M, bits, vec, xk):
    """Dynamic shared memory of a GEMV that stages x (xk = K): M*K floats and one sum per lane-step."""
    return 4 * M * (xk + xk // lane_elems(bits, vec)) if xk else 0


def gemv_inputs(norm, bias, res, head=None):
    names = ["x", "w", "sc", "bi"]
    if norm:
        names += ["nw"]
    if bias:
        names += ["bias"]
    if res:
        names += ["res"]
    if head is not None:
        if head["qknorm"]:
            names += ["qn", "kn"]
        names += ["off"] + (["rf"] if head["freqs"] else []) + ["kc", "vc", "cnt", "after"]
    return names


def _flt(v):
    return f"{float(v)!r}f"


def gemv_defines(dtype, M, bits, gs, epi, vec, R, nw, eps=None, bias=False, head=None, xk=0, fold=True, stream=0):
    """#defines of one GEMV kernel (K and N are run-time values, read from w's shape).
    eps: the folded input RMSNorm's epsilon (None: no norm); xk: x_stage's K or 0; fold:
    nibble_fold (FOLD4); stream: STREAM (blocks running row groups in turn; 0: one group each)."""
    d = dict(BITS=bits, GS=gs, M=M, R=R, NW=nw, VEC=vec, EPI=epi, FOLD4=fold, XK=xk, HAS_NORM=eps is not None,
             HAS_BIAS=bias, STREAM=stream)
    if eps is not None:
        d["EPS"] = _flt(eps)
    if head is not None:
        d.update(L=head["L"], H=head["H"], HKV=head["HKV"], D=head["D"], HAS_QKNORM=head["qknorm"],
                 QEPS=_flt(head["qeps"]), KEPS=_flt(head["keps"]), ROPE_TRAD=head["trad"],
                 ROPE_FREQS=head["freqs"], ROPE_LOG2_BASE=_flt(head["log2_base"]), ROPE_SCALE=_flt(head["scale"]))
    return d


def gemv_outputs(epi):
    return ["yq", "ys"] if epi == 3 else ["y"]


def gemv_blocks(N, epi, R, nw):
    """Blocks of one GEMV launch: NW warps of R output rows each (gate/up: N/2 output rows)."""
    nout = N // 2 if epi == 2 else N
    return -(-nout // (R * nw))


@cached_builder
def _gemv_build(dtype, M, bits, gs, epi, eps, bias, res, head_items, vec, R, nw, xk, fold):
    head = dict(head_items) if head_items else None
    src = source("gemv.cu", gemv_defines(dtype, M, bits, gs, epi, vec, R, nw, eps, bias, head, xk, fold), dtype)
    return cuda_kernel(name=_name("gemv", src), input_names=gemv_inputs(eps is not None, bias, res, head),
                       output_names=gemv_outputs(epi), source=src, ensure_row_contiguous=(epi != 3),
                       shared_memory=x_stage_bytes(M, bits, vec, xk))


def _gemv_kernel(dtype, M, K, N, bits, gs, epi, eps, bias, res, head_items, stage=True, fold=True):
    """(kernel, grid, threadgroup) for this call's sizes; eps: folded input RMSNorm or None;
    stage: x may be staged in shared memory (x_stage); fold: nibble_fold."""
    VEC, R, NW = gemv_config(M, K, N, bits, epi)
    xk = x_stage(M, K, dtype, stage)
    kern = _gemv_build(dtype, M, bits, gs, epi, eps, bias, res, head_items, VEC, R, NW, xk, fold)
    return kern, (gemv_blocks(N, epi, R, NW) * NW * 32, 1, 1), (NW * 32, 1, 1)


def gemv(x2d, w, epi=0, norm=None, res=None, stage=None, fold=None):
    """x2d [M, K] -> y [M, N or N/2]; `norm` = (weight, eps float) folds an input RMSNorm.
    stage / fold: x_stage / nibble_fold (None: on unless disabled)."""
    off = config.disabled() if stage is None or fold is None else ()
    stage = "x_stage" not in off if stage is None else stage
    fold = "nibble_fold" not in off if fold is None else fold
    M, K = x2d.shape
    N = w.out_features
    dtype = x2d.dtype
    bias = w.bias is not None and epi == 0
    kern, grid, tg = _gemv_kernel(dtype, M, K, N, w.bits, w.group_size, epi,
                                  None if norm is None else float(norm[1]), bias, res is not None, None, stage,
                                  fold)
    inputs = [x2d, w.weight, w.scales, w.biases]
    if norm is not None:
        inputs.append(norm[0])
    if bias:
        inputs.append(w.bias)
    if res is not None:
        inputs.append(res)
    nout = N // 2 if epi == 2 else N
    return kern(inputs=inputs, output_shapes=[(M, nout)], output_dtypes=[dtype], grid=grid,
                threadgroup=tg)[0]


def _unsupported_linear(in_features, splits, bits, group_size, dtype, bias, **_):
    if bits is None:
        return "float weights (stock matmul is already one GEMM)"
    if bits not in (4, 8) or group_size not in (32, 64, 128):
        return f"bits={bits} group_size={group_size}"
    if dtype not in _CTYPE:
        return f"dtype {dtype}"
    if in_features % 32:
        return f"in_features {in_features} not a multiple of 32"
    return None




def unsupported_qkv_proj(**info):
    return config.switched_off("qkv_kernel") or _unsupported_linear(**info)


def unsupported_lm_head(**info):
    return config.switched_off("lm_head_kernel") or _unsupported_linear(**info)


def unsupported_gate_up_silu(**info):
    return (config.switched_off("gate_up_kernel") or _unsupported_linear(**info)
            or ("bias on gate/up" if info.get("bias") else None))


def _rows(x):
    n = 1
    for s in x.shape[:-1]:
        n *= s
    return n


def _ref():
    from . import reference
    return reference


def qkv_proj(x, w):
    M = _rows(x)
    if M > MAX_ROWS or x.dtype != w.scales.dtype:
        return _ref().qkv_proj(x, w)
    y = gemv(x.reshape(M, -1), w)
    nq, nk, nv = w.splits
    lead = x.shape[:-1]
    return (y[:, :nq].reshape(*lead, nq), y[:, nq:nq + nk].reshape(*lead, nk),
            y[:, nq + nk:].reshape(*lead, nv))


def gate_up_silu(x, w):
    M = _rows(x)
    if M > MAX_ROWS or x.dtype != w.scales.dtype:
        return _ref().gate_up_silu(x, w)
    return gemv(x.reshape(M, -1), w, epi=2).reshape(*x.shape[:-1], w.splits[0])


def lm_head(x, w):
    M = _rows(x)
    if not w.quantized or M > MAX_ROWS or x.dtype != w.scales.dtype:
        return _ref().lm_head(x, w)
    return gemv(x.reshape(M, -1), w).reshape(*x.shape[:-1], w.out_features)


# ---------------------------------------------------------------------------------------------
# Decode attention
# ---------------------------------------------------------------------------------------------

ATTN_WARPS = 4        # warps per attention block
ATTN_MINCH = 16       # fewest positions per split
ATTN_MAX_SPLITS = 64  # the merge's shared weights table (MAXSPLIT in attention.cu)
ATTN_TARGET_BLOCKS = 264   # two blocks per SM on the H200's 132 SMs


def attn_splits(S, rows):
    """Splits per (b, l, kv head): enough blocks to fill the GPU, no more than the cache can use."""
    want = -(-ATTN_TARGET_BLOCKS // rows)
    return max(1, min(want, ATTN_MAX_SPLITS, -(-S // ATTN_MINCH)))


def attn_partials(rows, S, G, gb, D):
    """(splits, shapes of the partials pm and po) of an attention launch over `rows` (b, l, kv head)
    triples, each split further into G / gb head subgroups, over cache buffers of S slots."""
    nsplit = attn_splits(S, rows * G // gb)
    return nsplit, [(rows, nsplit, G, 2), (rows, nsplit, G, D)]


def attn_defines(L, H, HKV, D, scale, gb=None):
    """gb: query heads per block (a divisor of G = H / HKV; default G)."""
    G = H // HKV
    return dict(L=L, H=H, HKV=HKV, D=D, G=G, GB=gb or G, NW=ATTN_WARPS, MINCH=ATTN_MINCH,
                SCALE_LOG2=f"{float(scale) * LOG2E!r}f")


def tickets(n):
    """Zeroed int32 tickets for a kernel's last-block merge; every launch leaves them zero again.
    One buffer per user, whose launches must be ordered by their data (a FastBlock's kernels
    are). At least 16 bytes: out of MLX's small managed pool (see OFF_WORDS)."""
    t = mx.zeros((max(n, 4),), dtype=mx.int32)
    mx.eval(t)
    return t


@cached_builder
def _attn_kernel(dtype, L, H, HKV, D, scale, gb):
    src = source("attention.cu", attn_defines(L, H, HKV, D, scale, gb), dtype)
    return cuda_kernel(name=_name("attn", src), input_names=["q", "kc", "vc", "off", "cnt"],
                       output_names=["o", "pm", "po"], source=src, ensure_row_contiguous=False)


def attention(q, kc, vc, off, scale, cnt=None, gb=None):
    """q [B, L, H, D] (contiguous), kc/vc [B, HKV, S, D] cache buffers (read by strides; last axis
    contiguous), off int32[OFF_WORDS] (positions before this step in [0]) -> [B, L, H, D].
    cnt: int32 tickets, at least B*L*H, all zero (left zero). gb: query heads per block."""
    B, L, H, D = q.shape
    HKV, S = kc.shape[1], kc.shape[2]
    G = H // HKV
    gb = gb or G
    rows = B * L * HKV
    if cnt is None:
        # Calls from unrelated places may run concurrently in one CUDA graph: fresh tickets each
        # (a tiny fill kernel that the attention waits for).
        cnt = mx.zeros((max(rows * G // gb, 4),), dtype=mx.int32)
    kern = _attn_kernel(q.dtype, L, H, HKV, D, float(scale), gb)
    nsplit, partials = attn_partials(rows, S, G, gb, D)
    o, _, _ = kern(inputs=[q, kc, vc, off, cnt], output_shapes=[(B, L, H, D), *partials],
                   output_dtypes=[q.dtype, mx.float32, mx.float32],
                   grid=(nsplit * ATTN_WARPS * 32, HKV * G // gb, B * L), threadgroup=(ATTN_WARPS * 32, 1, 1))
    return o


def unsupported_decode_attention(head_dim=None, gqa=None, dtype=None, **_):
    if head_dim not in (64, 128, 256):
        return f"head_dim {head_dim}"
    if gqa is None or not 1 <= gqa <= MAX_GQA:
        return f"GQA group {gqa} (1-{MAX_GQA})"
    if dtype is not None and dtype not in _HALF:
        return f"dtype {dtype}"
    return None


# Offsets are int32[OFF_WORDS] (value in [0]): 16 bytes keeps them out of MLX's small pool of
# managed memory (arrays of <= 8 bytes), where host writes to neighbouring arrays make every
# kernel that reads one fault. Host-made offsets still fault once on first use; the compiled
# decode step therefore computes the next offset on the GPU.
OFF_WORDS = 4
_off_cache = {}


def offset_array(offset):
    a = _off_cache.get(offset)
    if a is None:
        if len(_off_cache) > 256:
            _off_cache.clear()
        a = _off_cache[offset] = mx.array([offset] + [0] * (OFF_WORDS - 1), dtype=mx.int32)
    return a


def decode_attention(q, k_cache, v_cache, length, scale):
    B, H, L, D = q.shape
    if (L != 1 or q.dtype not in _HALF or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype
            or v_cache.shape != k_cache.shape
            or unsupported_decode_attention(D, H // k_cache.shape[1])):
        return _ref().decode_attention(q, k_cache, v_cache, length, scale)
    if isinstance(length, mx.array):
        off = mx.pad((length.reshape(1) - 1).astype(mx.int32), (0, OFF_WORDS - 1))
    else:
        if not 0 < int(length) <= k_cache.shape[2]:
            raise ValueError(f"decode_attention: length {length} outside the cache (1..{k_cache.shape[2]})")
        off = offset_array(int(length) - 1)
    q4 = mx.contiguous(q).reshape(B, 1, H, D)
    return attention(q4, k_cache, v_cache, off, scale).reshape(B, H, 1, D)


# ---------------------------------------------------------------------------------------------
# One launch per decoder layer (default; MLX_FASTOPS_DISABLE=layer_kernel: 5 launches)
# ---------------------------------------------------------------------------------------------

# With 5 launches per layer a decode step was bound by MLX's host cost per kernel node (~10 us), not
# by the GPU (benchmarks/results/cuda_notes.md). This launch runs the 5 kernels of the fast path as 5 groups of
# blocks, in launch order; a block of group g first waits until every block of group g-1 has
# finished (a global counter). Blocks are dispatched in increasing index order, so the blocks
# waited for are already resident or done: no co-residency is needed. Each group's code is the
# unchanged kernel file, compiled as a device function with its own defines (BLOCK_X... = its
# block's coordinates within the group).


_LAYER_HELPERS = r"""
__device__ __forceinline__ long long layer_now() {
#ifdef __CUDA_ARCH__
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return static_cast<long long>(t);
#else
  static long long ticks = 0;   // CPU emulator: a logical clock, one tick per reading
  return ++ticks;
#endif
}
// Phase timing (layers_launch(stamps=True)): block b's entry and end times and its SM in
// stamps[3b], [3b+1], [3b+2]. The entry is stored at once (held in a register through the block,
// it cost the Qwen3-4B layer 38 registers in ptxas: 3 blocks per SM instead of 4); the end is
// taken once the whole block is done, before it counts as arrived. (Templates: the stamps' int64
// type is MLX's to name.)
template <typename I>
__device__ __forceinline__ void layer_stamp_entry(I* stamps) {
  if (threadIdx.x == 0) stamps[3 * blockIdx.x] = layer_now();
}
template <typename I>
__device__ __forceinline__ void layer_stamp(I* stamps) {
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned sm = 0;   // the CPU emulator runs everything on "SM 0"
#ifdef __CUDA_ARCH__
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
#endif
    stamps[3 * blockIdx.x + 1] = layer_now();
    stamps[3 * blockIdx.x + 2] = sm;
  }
}
__device__ __forceinline__ void prefetch_l2(const void* p) {
#ifdef __CUDA_ARCH__
  asm volatile("prefetch.global.L2 [%0];" :: "l"(p));
#endif
}
__device__ __forceinline__ void layer_done(const int* ctr, int g) {
  __threadfence();   // every thread's writes, then the block's arrival
  __syncthreads();
  if (threadIdx.x == 0) atomicAdd(const_cast<int*>(ctr) + g, 1);
}
__device__ __forceinline__ void layer_wait(const int* ctr, int g, int n) {
  if (g < 0) return;   // the launch's first group
  if (threadIdx.x == 0) {
    int spins = 0;
#if LAYER_WAIT_LOAD
    // plain loads: polls do not queue behind the arrivals' atomics on the counter's L2 line
    while (*reinterpret_cast<const volatile int*>(ctr + g) < n) {
#else
    while (atomicAdd(const_cast<int*>(ctr) + g, 0) < n) {
#endif
      // Never for long: the blocks waited for were dispatched first. A trap (~1 s) beats a hang.
      if (++spins > (1 << 22)) __trap();
      __nanosleep(200);
    }
    __threadfence();
  }
  __syncthreads();
}
"""

LAYER_GROUPS = 5   # QKV head, attention, o_proj, gate/up, down

_PTYPES = {"w": "const uint32_t*", "off": "const int32_t*", "cnt": "const int32_t*", "ctr": "const int32_t*",
           "rf": "const float*", "wait_g": "int", "wait_n": "int",
           "ys": "float*", "pm": "float*", "po": "float*"}


def _phase(fname, filename, defines, dtype, inputs, outputs, shaped=(), strided=()):
    """A kernel file as `__device__ void fname(int blk, ...)`; parameters in MLX's naming."""
    T = _CTYPE[dtype]
    params = ["int blk"]
    for n in inputs:
        params.append(f"{_PTYPES.get(n, f'const {T}*')} {n}")
        if n in shaped:
            params.append(f"const Shape& {n}_shape")
        if n in strided:
            params.append(f"const Strides& {n}_strides")
    params += [f"{_PTYPES.get(n, f'{T}*')} {n}" for n in outputs]
    body = source(filename, defines, dtype)
    undef = "\n".join(f"#undef {k}" for k in {**STANDALONE, **defines})
    return f"__device__ void {fname}({', '.join(params)}) {{\n{body}\n}}\n{undef}\n"


@cached_builder
def _layer_build(dtype, M, shapes, eps_in, eps_post, bias, head_items, nsplit, scale, gb=None, prefetch=False,
                 wait_load=False, nlayers=1, stamps=False, stage=True, fold=True, one_wave=False, stream=False,
                 attn_prefetch=False, loop=False):
    """The decoder layer as one launch; with nlayers > 1, that many consecutive layers (same
    shapes) in one launch (layer_groups). Returns (kernel, blocks per group, input names).

    shapes: ((bits, gs, N, K) of qkv, o, gate_up, down). gb: the attention's query heads per
    block. prefetch (layer_prefetch): the GEMV phases wait inside gemv.cu (WAIT_INPUTS), once
    their weights are on the way, instead of before they start; wait_load (layer_wait_load):
    waits poll with loads instead of atomics; stamps: an extra output with each block's entry and
    end times (layer_stamp); stage (x_stage): the GEMV phases stage x in shared memory where it fits
    (and the attention blocks' static shared memory is small: see below); fold: nibble_fold;
    one_wave: layer_one_wave (gemv_config); stream: layer_stream (stream_blocks; not the QKV phase, whose
    blocks complete heads); attn_prefetch: the attention phase sends its chunk's K/V rows to L2
    before it waits (inside attention.cu). Inputs of layer j carry the suffix j (x, off, the
    tickets and the counters are shared); layer j > 0 reads the previous layer's output from the
    scratch outputs r0/r1 (alternating), the last layer writes `out`. loop (layer_loop, nlayers >
    1): each phase has one call site, its layer's inputs picked at run time (_loop_body); else one
    call site per layer and phase."""
    head = dict(head_items)
    L, H, HKV, D = head["L"], head["H"], head["HKV"], head["D"]
    (qb, qg, qN, qK), (ob, og, oN, oK), (ub, ug, uN, uK), (db, dg, dN, dK) = shapes
    sizes = []   # blocks per phase
    smem = [0]   # dynamic shared memory: the largest staged x of the phases
    header = [f"#define LAYER_WAIT_LOAD {int(wait_load)}\n", _LAYER_HELPERS]
    waits = ["ctr", "wait_g", "wait_n"] if prefetch else []   # the phase waits inside (WAIT_INPUTS)

    # The launch's static shared memory is the sum of its phases'; attention blocks of more than 256
    # query-head values (GB * D) alone take 20-45 KB, and static + dynamic above 48 KB needs an
    # opt-in that MLX makes only for dynamic sizes above 48000 bytes (else the launch is refused).
    stage = stage and (gb or H // HKV) * D <= 256

    def gemv_phase(name, bits, gs, N, K, epi, eps, has_bias, res, hd):
        vec, R, nw = gemv_config(M, K, N, bits, epi, one_wave)
        xk = x_stage(M, K, dtype, stage)
        smem[0] = max(smem[0], x_stage_bytes(M, bits, vec, xk))
        nb = gemv_blocks(N, epi, R, nw)
        launched = stream_blocks(nb) if stream and epi != 3 else nb
        d = gemv_defines(dtype, M, bits, gs, epi, vec, R, nw, eps, has_bias, hd, xk, fold,
                         launched if launched < nb else 0)
        d.update(BLOCK_X="blk", BLOCK_Y=0, BLOCK_Z=0, GRID_X=0)
        if prefetch:
            d["WAIT_INPUTS"] = "layer_wait(ctr, wait_g, wait_n)"
        header.append(_phase(name, "gemv.cu", d, dtype, gemv_inputs(eps is not None, has_bias, res, hd) + waits,
                             gemv_outputs(epi), shaped=("w",), strided=("kc", "vc")))
        sizes.append(launched)

    gemv_phase("layer_qkv", qb, qg, qN, qK, 3, eps_in, bias, False, head)
    ad = attn_defines(L, H, HKV, D, scale, gb)
    ys = HKV * ad["G"] // ad["GB"]   # the attention grid's y: kv heads x head subgroups
    ad.update(BLOCK_X=f"(blk % {nsplit})", BLOCK_Y=f"((blk / {nsplit}) % {ys})",
              BLOCK_Z=f"(blk / {nsplit * ys})", GRID_X=nsplit)
    if attn_prefetch:
        ad["WAIT_INPUTS"] = "layer_wait(ctr, wait_g, wait_n)"
    header.append(_phase("layer_attn", "attention.cu", ad, dtype,
                         ["q", "kc", "vc", "off", "cnt"] + (["ctr", "wait_g", "wait_n"] if attn_prefetch else []),
                         ["o", "pm", "po"], strided=("kc", "vc")))
    sizes.append(nsplit * ys * M)
    gemv_phase("layer_o", ob, og, oN, oK, 1, None, False, True, None)
    gemv_phase("layer_gate_up", ub, ug, uN, uK, 2, eps_post, False, False, None)
    gemv_phase("layer_down", db, dg, dN, dK, 1, None, False, True, None)
    assert len(sizes) == LAYER_GROUPS
    groups = sizes * nlayers   # group g = LAYER_GROUPS * layer + phase, each waiting for g - 1
    # phase p (0-4) waits inside its kernel file (WAIT_INPUTS, after its prefetch) or before it
    waits_inside = lambda p: attn_prefetch if p == 1 else prefetch
    inside = lambda g: g > 0 and waits_inside(g % LAYER_GROUPS)   # group 0 never waits

    def phase_args(x, out, w):
        """[(function, arguments)] of one layer's phases; (base, kind) stands for the layer's own
        input `base` (kind "": the array, "_shape" / "_strides": its shape / strides). w(p):
        WAIT_INPUTS' arguments of phase p."""
        P = lambda base, kind="": (base, kind)
        qkv = [x, P("qkv_w"), P("qkv_w", "_shape"), P("qkv_sc"), P("qkv_bi"), P("in_nw")]
        qkv += ([P("qkv_bias")] if bias else []) + ([P("qn"), P("kn")] if head["qknorm"] else []) + ["off"]
        cache = [P("kc"), P("kc", "_strides"), P("vc"), P("vc", "_strides")]
        qkv += ([P("rf")] if head["freqs"] else []) + cache + ["head_cnt", P("after")]
        return [("layer_qkv", qkv + w(0) + ["yq", "ys"]),
                ("layer_attn", ["yq", *cache, "off", "attn_cnt"] + w(1) + ["o", "pm", "po"]),
                ("layer_o", ["o", P("o_w"), P("o_w", "_shape"), P("o_sc"), P("o_bi"), x] + w(2) + ["h"]),
                ("layer_gate_up", ["h", P("gu_w"), P("gu_w", "_shape"), P("gu_sc"), P("gu_bi"), P("post_nw")] + w(3)
                 + ["a"]),
                ("layer_down", ["a", P("dn_w"), P("dn_w", "_shape"), P("dn_sc"), P("dn_bi"), "h"] + w(4) + [out])]

    def layer_calls(j):
        """Layer j's phase calls, its inputs named with the suffix j."""
        x = "x" if j == 0 else f"r{(j - 1) % 2}"
        out = "out" if j == nlayers - 1 else f"r{j % 2}"
        def w(p):   # WAIT_INPUTS' arguments: the group before this phase (none before the first)
            g = LAYER_GROUPS * j + p
            return ["ctr", str(g - 1), str(groups[g - 1] if g > 0 else 0)] if waits_inside(p) else []
        name = lambda a: a if isinstance(a, str) else f"{a[0]}{j}{a[1]}"
        return [f"{f}(blk, {', '.join(map(name, args))})" for f, args in phase_args(x, out, w)]

    own = dict.fromkeys(a[0] for _, args in phase_args("x", "out", lambda p: []) for a in args
                        if not isinstance(a, str) and not a[1])   # a layer's own arrays, in call order
    inputs = ["x", "off", "head_cnt", "attn_cnt", "ctr"] + [f"{b}{j}" for j in range(nlayers) for b in own]
    if loop and nlayers > 1:
        body = _loop_body(phase_args, sizes, nlayers, waits_inside, stamps)
        return _layer_kernel(header, body, inputs, nlayers, stamps, smem[0]), groups, inputs
    calls = [c for j in range(nlayers) for c in layer_calls(j)]
    wait = lambda g: "" if g == 0 or inside(g) else f"layer_wait(ctr, {g - 1}, {groups[g - 1]});\n    "
    body = "  int blk = blockIdx.x;\n" + ("  layer_stamp_entry(stamps);\n" if stamps else "")
    stamp = "layer_stamp(stamps);\n    " if stamps else ""
    for g, (n, call) in enumerate(zip(groups[:-1], calls[:-1])):
        body += f"""  if (blk < {n}) {{
    {wait(g)}{call};
    {stamp}layer_done(ctr, {g});
    return;
  }}
  blk -= {n};
"""
    last = len(groups) - 1
    body += f"  {wait(last)}{calls[last]};\n  {stamp}"
    body += "".join(f"  {line}\n" for line in _counter_reset(last, groups[last], len(groups)))
    return _layer_kernel(header, body, inputs, nlayers, stamps, smem[0]), groups, inputs


def _counter_reset(group, arrivals, counters, only_if=""):
    """CUDA lines ending a launch's last phase: the block that finishes last (the `arrivals`-th
    of group counter `group`, where `only_if` also holds) zeroes the launch's `counters` group
    counters for the next launch."""
    return ["__threadfence();", "__syncthreads();",
            "if (threadIdx.x == 0) {   // the last block of the launch resets the counters for the next one",
            "  int* c = const_cast<int*>(ctr);",
            f"  if (atomicAdd(c + {group}, 1) == {arrivals} - 1{only_if}) {{",
            f"    for (int i = 0; i < {counters}; ++i) c[i] = 0;", "  }", "}"]


def _layer_kernel(header, body, inputs, nlayers, stamps, smem):
    # MLX puts the header before its `namespace mlx::core::cu {` (where Shape and Strides live)
    header = "namespace mlx::core::cu {\n" + "".join(header) + "}  // namespace mlx::core::cu\n"
    outputs = ["out", "yq", "ys", "o", "pm", "po", "h", "a"] + ["r0", "r1"][:min(nlayers - 1, 2)]
    outputs += ["stamps"] if stamps else []
    return cuda_kernel(name=_name("layer", header + body), input_names=inputs, output_names=outputs,
                       header=header, source=body, ensure_row_contiguous=False, shared_memory=smem)


# layer_loop: with one call site per layer and phase, NVRTC stops inlining every call in long
# launches (the PTX of Qwen3-0.6B's 8-layer launch calls out-of-line layer_qkv and layer_attn 12
# times; 5 layers: no calls), and those copies contract their float arithmetic differently: on the
# H200 that launch's output differed from one launch per layer in 1 of 4 random trials (Llama-3.2-1B:
# 3 of 4), the same way every run; 2 and 4 layers were bit-identical. So the phases get one call
# site each: a block finds its layer j and phase, then picks layer j's inputs from the kernel's
# parameters (a switch per phase), and the code is the one-layer launch's whatever the number of
# layers.
def _loop_body(phase_args, sizes, nlayers, waits_inside, stamps):
    """The multi-layer launch's body with one call site per phase: each block takes its layer j's
    inputs, picked at run time from the kernel's parameters (the picks name every layer's inputs
    literally: MLX passes an input's strides only where its source names them). phase_args: as in
    _layer_build; shapes are equal across the layers, so layer 0's serve."""
    per = sum(sizes)
    prev = "((j - 1) % 2 == 0 ? r0 : r1)" if nlayers > 2 else "r0"   # r1 exists from 3 layers on
    mine = "(j % 2 == 0 ? r0 : r1)" if nlayers > 2 else "r0"
    body = [f"  int blk = blockIdx.x;",
            f"  const int j = blk / {per};   // the block's layer, and its index within the layer",
            f"  blk -= j * {per};", f"  const int g0 = j * {LAYER_GROUPS};   // the layer's first group"]
    body += ["  layer_stamp_entry(stamps);"] if stamps else []
    body += [f"  const auto xin = j == 0 ? x : {prev};   // the layer's input and output",
             f"  const auto yout = j == {nlayers - 1} ? out : {mine};"]
    last = LAYER_GROUPS - 1
    before = lambda p: f"g0 - 1" if p == 0 else f"g0 + {p - 1}"   # the group this phase waits for
    # WAIT_INPUTS' arguments (g < 0: the launch's first group, no wait)
    w = lambda p: ["ctr", before(p), str(sizes[(p - 1) % LAYER_GROUPS])] if waits_inside(p) else []
    kinds = {"": "{}_", "_shape": "{}0_shape", "_strides": "*{}_strides_"}
    for p, (n, (f, args)) in enumerate(zip(sizes, phase_args("xin", "yout", w))):
        own = [a for a in args if not isinstance(a, str)]
        names = list(dict.fromkeys(b for b, k in own if not k))
        strided = list(dict.fromkeys(b for b, k in own if k == "_strides"))
        call = f"{f}(blk, {', '.join(a if isinstance(a, str) else kinds[a[1]].format(a[0]) for a in args)})"
        pick = lambda k: " ".join([f"{m}_ = {m}{k};" for m in names] +
                                  [f"{m}_strides_ = &{m}{k}_strides;" for m in strided])
        lines = [f"  if (blk < {n}) {{"]
        lines += [f"    auto {m}_ = {m}0;" for m in names] + [f"    auto {m}_strides_ = &{m}0_strides;" for m in strided]
        lines += ["    switch (j) {"] + [f"      case {k}: {pick(k)} break;" for k in range(1, nlayers)] + ["    }"]
        if not waits_inside(p):
            lines.append(f"    layer_wait(ctr, {before(p)}, {sizes[(p - 1) % LAYER_GROUPS]});")
        lines.append(f"    {call};")
        lines += ["    layer_stamp(stamps);"] if stamps else []
        if p < last:
            lines += [f"    layer_done(ctr, g0 + {p});", "    return;", "  }", f"  blk -= {n};"]
        else:   # the last layer's last phase: the launch's last block resets the counters
            reset = _counter_reset(f"g0 + {last}", n, LAYER_GROUPS * nlayers, f" && j == {nlayers - 1}")
            lines += [f"    {line}" for line in reset] + ["  }"]
        body += lines
    return "\n".join(body) + "\n"


# ---------------------------------------------------------------------------------------------
# Static KV cache and the fused decode block
# ---------------------------------------------------------------------------------------------

class StaticKVCache(KVCache):
    """KVCache whose buffers grow in big steps and are written in place by the fast decode path.

    Prefill (and every path that is not the fast path) writes through `update_and_fetch` exactly
    like KVCache (slice assignment, in place when MLX can donate); the fast decode kernels write
    the new k/v rows straight into `keys`/`values` at `offset`.

    MLX does not see those in-place writes, and MLX's CUDA graphs order kernels only by the
    buffers they declare (a kernel waits for the last kernel that output one of its input
    buffers). So the order is made explicit: `last_reader` is the output of the latest fast-path
    attention over the buffers; the next fast-path writer (the head kernel) takes it as an extra
    input, and stock code that touches the buffers (`update_and_fetch`, growth) evaluates it
    first. Without this, steps built lazily whose inputs do not depend on each other (teacher
    forcing) could run out of order in one graph.
    """

    step = 1024
    last_reader = None

    def _ordered(self):
        """Finish the fast path's pending kernels before stock ops read or write the buffers."""
        if self.last_reader is not None:
            mx.eval(self.last_reader)
            self.last_reader = None

    def reserve(self, B, n_kv, D, dtype, needed):
        k = self.keys
        if k is not None and k.shape[2] >= needed and k.shape[0] == B and k.shape[1] == n_kv \
                and k.shape[3] == D and k.dtype == dtype:
            return
        self._ordered()
        S = -(-needed // self.step) * self.step
        nk = mx.zeros((B, n_kv, S, D), dtype=dtype)
        nv = mx.zeros((B, n_kv, S, D), dtype=dtype)
        if self.keys is not None and self.offset > 0:
            nk[..., : self.offset, :] = self.keys[..., : self.offset, :]
            nv[..., : self.offset, :] = self.values[..., : self.offset, :]
        self.keys, self.values = nk, nv

    def update_and_fetch(self, keys, values):
        B, n_kv, L, D = keys.shape
        prev = self.offset
        self.reserve(B, n_kv, D, keys.dtype, prev + L)
        self._ordered()
        self.offset += L
        self.keys[..., prev : self.offset, :] = keys
        self.values[..., prev : self.offset, :] = values
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    def fast_inputs(self):
        """(keys, values, after) for the fast path's in-place writer; `after` is the last reader
        (the writer's kernel takes it as an input, so it waits for it), else the keys again."""
        return self.keys, self.values, self.keys if self.last_reader is None else self.last_reader


def _quant_ok(m):
    return (isinstance(m, nn.QuantizedLinear) and getattr(m, "mode", "affine") == "affine"
            and m.bits in (4, 8) and m.group_size in (32, 64, 128) and "bias" not in m)


def _as_packed(m):
    from ..ops.weights import PackedLinear
    K = m.weight.shape[1] * 32 // m.bits
    return PackedLinear(m.weight, m.scales, m.biases, None, (m.weight.shape[0],), K, m.bits, m.group_size)


# One launch per layer, with its GEMV phases starting their weights before they wait and attention
# blocks of 2 query heads, was on average faster than 5 launches on the H200 for every model
# measured (Qwen3-8B 1.03-1.38x in 4 of 4 side-by-side comparisons; Qwen3-4B 0.84-1.38x, mean
# 1.09x, within the run-to-run noise). Several layers per launch (layer_groups) wins on small layers
# (Qwen3-0.6B 15M weights per layer (M = 2^20), Llama-3.2-1B 58M: 1.25-1.4x); on large ones (Qwen3-4B
# 96M, 8B 184M) it lost ~10% before layer_loop and, with it, gains nothing measurable (4B: 2, 6 or 36
# per launch within 2% of one per launch; 8B: within the noise), hence the bound. See
# benchmarks/results/cuda_notes.md (cuda_host_looped.md).
GROUP_MAX_WEIGHTS = 64 << 20


class FastBlock:
    """The fused decode path of one decoder block (see the module docstring): one launch (shared
    with the following blocks in the compiled step, where group_layers), or (layer_kernel in
    `disabled`) the same 5 kernels as 5 launches."""

    def __init__(self, block, disabled=()):
        attn, mlp = block._attention, block._mlp
        self.qkv = attn.qkv_weights
        self.gate_up = mlp.gate_up_weights
        self.o = _as_packed(attn._o)
        self.down = _as_packed(mlp._down)
        self.H, self.HKV = attn.n_heads, attn.n_kv_heads
        self.D = self.qkv.splits[0] // self.H
        self.scale = float(attn.scale)
        dtype = self.qkv.scales.dtype
        self.dtype = dtype
        self.in_norm = (block._input_norm.weight, float(block._input_norm.eps))
        self.post_norm = (block._post_norm.weight, float(block._post_norm.eps))
        rope = attn.rope_spec
        self.qknorm = attn.has_qk_norm
        self.qk = [attn._q_norm.weight, attn._k_norm.weight] if self.qknorm else []
        self.rf = [rope.freqs.astype(mx.float32)] if rope.freqs is not None else []
        base = rope.base if rope.base is not None else 1.0
        self.head = (("D", self.D), ("H", self.H), ("HKV", self.HKV), ("freqs", bool(self.rf)),
                     ("keps", float(attn._k_norm.eps) if self.qknorm else 0.0),
                     ("log2_base", math.log2(base)), ("qeps", float(attn._q_norm.eps) if self.qknorm else 0.0),
                     ("qknorm", self.qknorm), ("scale", float(rope.scale)), ("trad", bool(rope.traditional)))
        self.K = self.qkv.in_features
        # this block's own tickets (head kernel: one per q/k/v head; attention: per row, kv head
        # and head subgroup)
        self.head_tickets = tickets(self.H + 2 * self.HKV)
        self.attn_tickets = tickets(MAX_ROWS * self.H)   # per row, kv head and head subgroup
        self._counters = {}   # layer launches' group counters, per layers per launch
        self.weights = sum(w.in_features * w.out_features for w in (self.qkv, self.gate_up, self.o, self.down))
        self.one_launch = "layer_kernel" not in disabled
        # the one-launch layer's variants (each measured faster on the H200; see config.FUSIONS)
        variant = lambda name: self.one_launch and name not in disabled
        self.prefetch = variant("layer_prefetch")
        self.wait_load = variant("layer_wait_load")
        self.stage = "x_stage" not in disabled
        self.fold = "nibble_fold" not in disabled
        self.one_wave = variant("layer_one_wave")
        self.stream = variant("layer_stream")
        self.attn_prefetch = variant("attn_prefetch")
        self.loop = variant("layer_loop")
        large = self.weights > GROUP_MAX_WEIGHTS
        self.group_layers_off = ("layer_kernel disabled" if not self.one_launch else
                                 "disabled" if "layer_groups" in disabled else
                                 f"{self.weights >> 20}M weights per layer > {GROUP_MAX_WEIGHTS >> 20}M: "
                                 "several per launch measured no faster" if large else None)
        self.group_layers = self.group_layers_off is None
        # query heads per attention block: at most 2 (fewer registers) or all G
        G = self.H // self.HKV
        self.gb = 2 if variant("attn_head_split") and G % 2 == 0 else G
        mx.eval(self.in_norm[0], self.post_norm[0], self.qk, self.rf)

    @staticmethod
    def unsupported(block):
        attn, mlp = block._attention, block._mlp
        qkv = getattr(attn, "qkv_weights", None)
        gu = getattr(mlp, "gate_up_weights", None)
        rope = getattr(attn, "rope_spec", None)
        if qkv is None or not qkv.quantized:
            return "QKV not fused / not quantised"
        if gu is None or not gu.quantized:
            return "gate/up not fused / not quantised"
        if not (_quant_ok(attn._o) and _quant_ok(mlp._down)):
            return "o_proj/down_proj not affine 4/8-bit without bias"
        if rope is None:
            return "RoPE variant"
        D = qkv.splits[0] // attn.n_heads
        if rope.dims != D:
            return f"partial rotary ({rope.dims} of {D})"
        if D not in (64, 128, 256):
            return f"head_dim {D}"
        if attn.n_heads % attn.n_kv_heads or not 1 <= attn.n_heads // attn.n_kv_heads <= MAX_GQA:
            return f"GQA group {attn.n_heads / attn.n_kv_heads:g} (1-{MAX_GQA})"
        if qkv.scales.dtype not in _HALF:
            return f"dtype {qkv.scales.dtype}"
        if type(block._input_norm) is not nn.RMSNorm or type(block._post_norm) is not nn.RMSNorm:
            return "norm type"
        for w in (qkv, gu):
            if w.in_features % 32:
                return "in_features not a multiple of 32"
        return None

    cache_type = None  # set below (StaticKVCache)

    def supports(self, x):
        B, L, _ = x.shape
        M = B * L
        return M <= MAX_ROWS and x.dtype == self.dtype

    def core(self, x, off, kc, vc, after):
        """x [B, L, K], off int32[OFF_WORDS] (cache length before these tokens in [0]) -> (block
        output, the attention output: the new last reader of kc/vc). Writes this step's k/v rows
        into kc/vc in place, after the kernel that output `after` (the previous reader)."""
        if self.one_launch:
            return self.core_one_launch(x, off, kc, vc, after)
        B, L, K = x.shape
        M = B * L
        qkv = self.qkv
        kern, grid, tg = _gemv_kernel(x.dtype, M, K, qkv.out_features, qkv.bits, qkv.group_size, 3,
                                      self.in_norm[1], qkv.bias is not None, False, self.head + (("L", L),),
                                      self.stage, self.fold)
        bias = [qkv.bias] if qkv.bias is not None else []
        head_inputs = [x, qkv.weight, qkv.scales, qkv.biases, self.in_norm[0], *bias, *self.qk, off, *self.rf,
                       kc, vc, self.head_tickets, after]   # gemv_inputs order for EPI 3
        q = kern(inputs=head_inputs, output_shapes=[(B, L, self.H, self.D), (M, qkv.out_features)],
                 output_dtypes=[x.dtype, mx.float32], grid=grid, threadgroup=tg)[0]
        o = attention(q, kc, vc, off, self.scale, self.attn_tickets, self.gb)
        x2 = x.reshape(M, K)
        h = gemv(o.reshape(M, self.H * self.D), self.o, epi=1, res=x2, stage=self.stage, fold=self.fold)
        a = gemv(h, self.gate_up, epi=2, norm=self.post_norm, stage=self.stage, fold=self.fold)
        out = gemv(a, self.down, epi=1, res=h, stage=self.stage, fold=self.fold)
        return out.reshape(B, L, K), o

    def core_one_launch(self, x, off, kc, vc, after):
        """`core` as a single launch (see _layer_build): same arithmetic, same outputs."""
        return layers_launch([self], x, off, [(kc, vc, after)])

    def layer_counters(self, nlayers):
        """Zeroed group counters of a launch of nlayers layers led by this block (left zero)."""
        c = self._counters.get(nlayers)
        if c is None:
            c = self._counters[nlayers] = tickets(LAYER_GROUPS * nlayers)
        return c

    def layer_arrays(self, j, kc, vc, after):
        """This block's inputs of a layer launch, as layer j (names of _layer_build)."""
        qkv, o, gu, dn = self.qkv, self.o, self.gate_up, self.down
        a = {"qkv_w": qkv.weight, "qkv_sc": qkv.scales, "qkv_bi": qkv.biases, "in_nw": self.in_norm[0],
             "kc": kc, "vc": vc, "after": after, "o_w": o.weight, "o_sc": o.scales, "o_bi": o.biases,
             "gu_w": gu.weight, "gu_sc": gu.scales, "gu_bi": gu.biases, "post_nw": self.post_norm[0],
             "dn_w": dn.weight, "dn_sc": dn.scales, "dn_bi": dn.biases}
        if qkv.bias is not None:
            a["qkv_bias"] = qkv.bias
        if self.qknorm:
            a["qn"], a["kn"] = self.qk
        if self.rf:
            a["rf"] = self.rf[0]
        return {f"{k}{j}": v for k, v in a.items()}

    def launch_key(self):
        """What must agree for blocks to share a launch (everything but the weights and caches)."""
        ws = tuple((w.bits, w.group_size, w.out_features, w.in_features, w.bias is not None)
                   for w in (self.qkv, self.o, self.gate_up, self.down))
        return (self.dtype, ws, self.in_norm[1], self.post_norm[1], self.head, self.scale, self.gb,
                self.prefetch, self.wait_load, self.stage, self.fold, self.one_wave, self.stream, self.attn_prefetch,
                self.loop)

    def __call__(self, x, cache):
        if not self.supports(x):
            return None
        B, L, _ = x.shape
        prev = cache.offset
        cache.reserve(B, self.HKV, self.D, x.dtype, prev + L)
        out, cache.last_reader = self.core(x, offset_array(prev), *cache.fast_inputs())
        cache.offset = prev + L
        return out


FastBlock.cache_type = StaticKVCache


def layers_launch(blocks, x, off, bufs, stamps=False):
    """Consecutive decoder layers (FastBlocks with one launch_key) in one launch: x [B, L, K] ->
    (output of the last, the attention scratch output: the new last reader of every layer's
    cache). bufs: (kc, vc, after) per block. With stamps (benchmarks/cuda_layer_phases.py), also
    (int64 [blocks, 3]: each block's entry and end time in ns and its SM, blocks per group in launch order)."""
    fb = blocks[0]
    B, L, K = x.shape
    M = B * L
    qkv, gu = fb.qkv, fb.gate_up
    nsplit, partials = attn_partials(M * fb.HKV, bufs[0][0].shape[2], fb.H // fb.HKV, fb.gb, fb.D)
    shapes = tuple((w.bits, w.group_size, w.out_features, w.in_features) for w in (qkv, fb.o, gu, fb.down))
    kern, groups, names = _layer_build(x.dtype, M, shapes, fb.in_norm[1], fb.post_norm[1], qkv.bias is not None,
                                       fb.head + (("L", L),), nsplit, fb.scale, fb.gb, fb.prefetch, fb.wait_load,
                                       len(blocks), stamps, fb.stage, fb.fold, fb.one_wave, fb.stream,
                                       fb.attn_prefetch, fb.loop)
    nblocks = sum(groups)
    arrays = {"x": x, "off": off, "head_cnt": fb.head_tickets, "attn_cnt": fb.attn_tickets,
              "ctr": fb.layer_counters(len(blocks))}
    for j, (b, (kc, vc, after)) in enumerate(zip(blocks, bufs)):
        arrays.update(b.layer_arrays(j, kc, vc, after))
    f32 = mx.float32
    shapes_out = [(B, L, K), (B, L, fb.H, fb.D), (M, qkv.out_features), (B, L, fb.H, fb.D), *partials, (M, K),
                  (M, gu.out_features // 2)]
    dtypes_out = [x.dtype, x.dtype, f32, x.dtype, f32, f32, x.dtype, x.dtype]
    extra = min(len(blocks) - 1, 2)   # r0, r1: the residual stream between the layers
    shapes_out += [(M, K)] * extra + ([(nblocks, 3)] if stamps else [])
    dtypes_out += [x.dtype] * extra + ([mx.int64] if stamps else [])
    outs = kern(inputs=[arrays[n] for n in names], output_shapes=shapes_out, output_dtypes=dtypes_out,
                grid=(nblocks * 128, 1, 1), threadgroup=(128, 1, 1))
    return (outs[0], outs[3], outs[-1], groups) if stamps else (outs[0], outs[3])

# mlx-lm's load_prompt_cache finds cache classes by name in its own module: let it find ours, so a
# prompt cache saved from a patched model (mlx_lm.cache_prompt, save_prompt_cache) loads again.
_mlx_lm_cache.StaticKVCache = StaticKVCache


# The fast path fuses all of these; switching any of them off (A/B runs) switches it off.
FAST_PATH_PARTS = ("qkv_kernel", "gate_up_kernel", "attention", "qk_norm_rope", "residual_norm")


def fast_block(block, disabled=()):
    """(callable(x, cache) -> out or None, reason): the fused decode path for a FusedBlock."""
    off = [n for n in FAST_PATH_PARTS if n in disabled]
    if off:
        return None, f"parts disabled: {','.join(off)}"
    reason = FastBlock.unsupported(block)
    if reason:
        return None, reason
    return FastBlock(block, disabled), None


def make_cache(model):
    return [StaticKVCache() for _ in model.layers]


# ---------------------------------------------------------------------------------------------
# Whole decode step under mx.compile
# ---------------------------------------------------------------------------------------------

def _compiled_call(self, inputs, cache=None, input_embeddings=None):
    step = self.__dict__.get("_fastops_step")
    if (step is not None and input_embeddings is None and cache is not None and inputs.ndim == 2
            and inputs.shape[0] * inputs.shape[1] <= MAX_ROWS):
        blocks = self._fastops_blocks
        c0 = cache[0]
        if (type(c0) is StaticKVCache and len(cache) == len(blocks)
                and all(type(c) is StaticKVCache and c.offset == c0.offset for c in cache)):
            B, L = inputs.shape
            prev = c0.offset
            bufs = []
            for fb, c in zip(blocks, cache):
                c.reserve(B, fb.HKV, fb.D, fb.dtype, prev + L)
                bufs.extend(c.fast_inputs())
            dev = self.__dict__.get("_fastops_off")   # (offset value, int32 array on the GPU)
            off = dev[1] if dev is not None and dev[0] == prev else offset_array(prev)
            h, off_next, *readers = step(inputs, off, *bufs)
            object.__setattr__(self, "_fastops_off", (prev + L, off_next))
            for c, r in zip(cache, readers):
                c.offset = prev + L
                c.last_reader = r
            return h
    return super(self.__class__, self).__call__(inputs, cache=cache, input_embeddings=input_embeddings)


_INNER_CLASSES = {}


LAYERS_PER_LAUNCH = None   # layer_groups: the most layers in one launch (None: no limit)
# without layer_loop: launches of more layers were not bit-identical to one per layer (_loop_body)
UNLOOPED_LAYERS_MAX = 4


def launch_runs(fasts):
    """[(first block, blocks)] in order: consecutive one-launch blocks of one launch_key share a
    launch (group_layers, i.e. layer_groups not disabled), up to LAYERS_PER_LAUNCH (without
    layer_loop up to UNLOOPED_LAYERS_MAX); otherwise one block each."""
    runs, i = [], 0
    while i < len(fasts):
        n = 1
        if fasts[i].group_layers:
            most = LAYERS_PER_LAUNCH or len(fasts)
            most = most if fasts[i].loop else min(most, UNLOOPED_LAYERS_MAX)
            while (n < most and i + n < len(fasts) and fasts[i + n].group_layers
                   and fasts[i + n].launch_key() == fasts[i].launch_key()):
                n += 1
        runs.append((i, n))
        i += n
    return runs


def fast_model(model, blocks):
    """Swap model.model's class for one whose decode step is one mx.compile'd function
    (embedding, every FastBlock, final norm). Returns ((obj, stock class, fast class), None) or
    (None, reason); the patcher swaps the class back on unpatch (the attributes stay, unused)."""
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "embed_tokens") or not hasattr(inner, "norm"):
        return None, "no inner model with embed_tokens/norm"
    fasts = [b.fast_fn for b in blocks]
    if any(f is None for f in fasts):
        return None, "not every block has the fast decode path"
    if getattr(inner, "pipeline_size", 1) != 1:
        return None, "pipeline-parallel model"
    embed, norm = inner.embed_tokens, inner.norm
    dtype = fasts[0].dtype

    runs = launch_runs(fasts)

    def step(tokens, off, *bufs):
        h = embed(tokens)
        if h.dtype != dtype:
            h = h.astype(dtype)
        readers = []
        for i, n in runs:
            if n == 1:
                h, o = fasts[i].core(h, off, *bufs[3 * i:3 * i + 3])
            else:
                h, o = layers_launch(fasts[i:i + n], h, off, [bufs[3 * k:3 * k + 3] for k in range(i, i + n)])
            readers += [o] * n
        return [norm(h), off + tokens.shape[1], *readers]

    # An embedding in another dtype would make stock and fused paths differ: require a match.
    if getattr(embed, "scales", getattr(embed, "weight", None)).dtype != dtype:
        return None, "embedding dtype differs from the layers'"
    base = type(inner)
    cls = _INNER_CLASSES.get(base)
    if cls is None:
        cls = _INNER_CLASSES[base] = type(f"FastStep{base.__name__}", (base,), {"__call__": _compiled_call})
    object.__setattr__(inner, "_fastops_step", mx.compile(step))
    object.__setattr__(inner, "_fastops_blocks", fasts)
    inner.__class__ = cls
    return (inner, base, cls), None
