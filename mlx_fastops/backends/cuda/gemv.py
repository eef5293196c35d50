"""Quantised GEMV family for 1-8 activation rows (cuda/gemv.cu): the decode projections.

    y[m, n] = sum_k x[m, k] * (s[n, k / GS] * q[n, k] + b[n, k / GS])     (MLX affine format)

Epilogues (EPI): 0 plain (+ bias), 1 + residual, 2 SiLU(gate) * up, 3 the QKV head (q/k norm, RoPE,
k/v written into the cache; only inside the one-launch layer, or alone in tests). The ops qkv_proj
and gate_up_silu run EPI 0 / 2 for up to MAX_ROWS rows, lm_head EPI 0 for one row (and 2-8 that
qmm does not take); their other row counts and linear's go elsewhere (`linear`, `lm_head` below:
tensor cores, dense prefill, stock). Per call the kernel is picked by its static shape class
(dtype, rows, bits, group size, epilogue); K and N are read from the weight's shape at run time.
"""

import mlx.core as mx
from mlx_lm.models.activations import swiglu

from ...kernels import cached_builder, cuda_kernel
from .. import reference
from . import prefill, qmm
from .head import cache_inputs, head_defines
from .source import CTYPE, HALF, MAX_ROWS, flt, kernel_name, rows, source

# Blocks of 128 threads resident at once on the H200 (132 SMs, 4 blocks each at <= 128 registers).
BLOCKS_PER_SM = 4
RESIDENT_BLOCKS = BLOCKS_PER_SM * 132
ONE_WAVE_MIN_K = 2048   # rows this long take more rows per warp rather than a second wave
ACCUMULATORS_MAX = 8   # per lane, beside 8- or 16-byte loads of 2-4 rows: weight rows per warp x rows
HEAD_QMM_FROM = 2   # lm_head rows from which the tensor-core qmm takes over from the GEMV (lm_head below)


def lane_elems(bits, vec):
    """EPW of gemv.cu: the k a lane covers per step (VEC uint32 words of 8 nibbles or 4 bytes)."""
    return (8 if bits == 4 else 4) * vec


def gemv_config(M, K, N, bits, epi, one_wave=False):
    """(VEC, R, NW): uint32 words per lane load, rows per warp, warps per block.

    Decode GEMVs are latency-bound: few rows per warp and small blocks give many short, parallel
    chains. Two rows per warp only where there are rows to spare (and always for the head kernel,
    whose blocks must tile a head), and (one_wave: the phases of the one-launch layer) 2 or 4 where
    fewer would leave a second wave of blocks with long rows (K >= ONE_WAVE_MIN_K) to run after the
    first: Qwen3-4B o_proj/down 640 -> 320 blocks, Qwen3-4B/8B QKV 768 -> 384. At most 4 weight rows
    per warp (gate/up: 2 gate + 2 up), as many as gate/up already holds. A lane loads 16 bytes of
    each row per k-step up to 2 rows, 8 up to 4, then 4, and where it loads more than 4 bytes beside
    more than one row, at most ACCUMULATORS_MAX (weight rows x activation rows): Qwen3-4B's layer
    launch at 4 rows 144 -> 105 registers (offline ptxas), 3 -> 4 blocks per SM. From 5 rows on a
    warp keeps the rows of one row: where x is unstaged (Qwen3-4B/8B at 8 rows) a warp converts it
    once for all of them (at 8 rows 2 blocks per SM; one row per warp at 4 blocks per SM was slower:
    4B / 8B layer 363 / 561 vs 323 / 437 us). Qwen3-4B/8B's QKV at 3-4 rows: 768 blocks, two waves (where
    it is not on gemv_mma.cu: mma_takes)."""
    VEC = 4 if M <= 2 else (2 if M <= 4 else 1)
    while VEC > 1 and K % lane_elems(bits, VEC):
        VEC //= 2
    nout = N // 2 if epi == 2 else N
    per_out = 2 if epi == 2 else 1              # weight rows per warp per output row
    rmax = 4 // per_out if M == 1 or VEC == 1 else max(1, min(4, ACCUMULATORS_MAX // M) // per_out)
    R = min(rmax, 2) if (epi == 3 or nout >= 4096) else 1
    while one_wave and 2 * R <= rmax and K >= ONE_WAVE_MIN_K and gemv_blocks(N, epi, R, 4) > RESIDENT_BLOCKS:
        R *= 2   # the head kernel's blocks still tile a head: 4 warps x 4 rows divide D = 64/128/256
    return VEC, R, 4


# A GEMV stages x in shared memory (gemv.cu, XK): as floats up to STAGE_MAX_FLOATS elements (16 KB
# per block; the staging registers hold 32 elements per thread: Qwen3-8B's hidden size at batch 1,
# Qwen3-0.6B's up to 4 rows), else from 2 rows on as T values (XT) up to STAGE_MAX_BYTES with their
# lane-step sums: within the 48 KB a launch has beside the one-launch layer's ~12-16 KB of static
# shared memory (more takes MLX's opt-in above 48000 dynamic bytes, and 4 blocks per SM would not
# fit). E.g. Qwen3-4B's QKV and gate/up up to 5 rows and o_proj up to 3, Qwen3-8B's up to 3.
STAGE_MAX_FLOATS = 4096
STAGE_MAX_BYTES = 32 * 1024


def stream_blocks(nb):
    """Blocks launched for a phase of the one-launch layer with nb row groups, each running
    ceil(nb / blocks) of them in turn (gemv.cu, STREAM): one wave of equal shares where nb would
    leave later waves (Qwen3-8B gate/up 1536 -> 512 blocks of 3, 4B 1216 -> 406; gemv_mma.cu's
    blocks of 3 or more take theirs from a tile queue instead: layer.py)."""
    if nb <= RESIDENT_BLOCKS:
        return nb
    per = -(-nb // RESIDENT_BLOCKS)
    return -(-nb // per)


def x_stage(M, K, dtype, bits, vec, room=True):
    """(XK, XT) of gemv.cu: (K, 0) where a GEMV stages its x as floats, (K, 1) as T values, (0, 0)
    where it does not (half types, where it fits and the launch has shared memory to spare: `room`)."""
    if not room or dtype not in HALF:
        return 0, 0
    if M * K <= STAGE_MAX_FLOATS:
        return K, 0
    if M > 1 and x_stage_bytes(M, bits, vec, (K, 1)) <= STAGE_MAX_BYTES:
        return K, 1
    return 0, 0


def x_stage_bytes(M, bits, vec, stage):
    """Dynamic shared memory of a GEMV that stages x (stage = x_stage's (K, XT)): M*K floats (XT: T
    values) and one float sum per lane-step."""
    xk, xt = stage
    return M * ((2 if xt else 4) * xk + 4 * (xk // lane_elems(bits, vec)))


# The one-launch layer's gate/up phase runs on tensor cores (cuda/gemv_mma.cu) at any rows; its
# o_proj, down and QKV phases (QKV: in large layers, where a head is whole tiles) from MMA_MIN_ROWS
# rows, and at one row where their tiles (of 8 rows: TILE8) fill more than half of the wave's block
# slots; the weights 4-bit in groups of 64, K a multiple of 256. Phase tables (H200,
# docs/cuda-design.md): gate/up gains at every row count; o_proj and down gain from 2 rows on every
# benchmark model, at one row on Qwen3-4B / 8B (320 / 512 tiles: 53.9 -> 51.6 / 69.8 -> 68.1 us a
# layer) and not on Llama-3.2-1B (down, 256 tiles: 8.6 -> 9.7 us) or Qwen3-0.6B (128 tiles: even).
# QKV, us per phase: Qwen3-4B at 2 / 4 rows 17.0 -> 12.3, 23.7 -> 14.3, 8B 21.8 -> 16.4, 41.1 ->
# 20.3; at one row (384 tiles), since the first staging step's loads go out with the norm's, 11.0 ->
# 10.4 and 14.2 -> 13.2 (2026-12-05). Only in large layers (over block.GROUP_MAX_WEIGHTS weights,
# one-layer launches then): at 2 rows Qwen3-0.6B's and Llama-3.2-1B's several-layer launches ran at 3
# blocks per SM (layers 30.1 -> 32.8, 44.4 -> 53.1 us; before the staging of two items a thread);
# at one row (256 / 192 tiles) their QKV phases ran 0.2-0.5 us slower.
MMA_MIN_ROWS = 2
_MMA_WARPS = 4   # a block's warps, splitting K
_MMA_PARTIALS = _MMA_WARPS * 32 * 16   # bytes of a tile's partials (32 lanes x float4 a warp)
_MMA_GROUP_ROW_BYTES = 128 + 4   # staged x of a group of 64 and a row: T values, then sum x in fp32
# gemv_mma.cu stages its x but in TILE8 phases (in K slices where all of it does not fit), within its
# own bound: the 32 KB of gemv.cu's STAGE_MAX_BYTES.
MMA_STAGE_MAX_BYTES = 32 * 1024


def mma_tile8(N, epi):
    """Whether an EPI 1 phase of gemv_mma.cu takes tiles of 8 rows (TILE8): where tiles of 16 would
    leave block slots of the wave idle (Qwen3-4B o_proj / down 160 -> 320 blocks)."""
    return epi == 1 and -(-N // 8) <= RESIDENT_BLOCKS


def mma_tiles(N, epi):
    """Tiles of gemv_mma.cu: 16 weight rows (EPI 2: 8 gate rows and their 8 up rows; TILE8: 8)."""
    return -(-(N // 2 if epi == 2 else N) // (8 if epi == 2 or mma_tile8(N, epi) else 16))


def mma_plan(M, K, N, epi):
    """(KS, TPB, blocks) of a gemv_mma.cu phase: groups of 64 per K slice, sets of partials kept
    in shared memory, blocks launched. All of K in one slice for TILE8 (x not staged) and where M
    rows of staged x fit in MMA_STAGE_MAX_BYTES beside one set of partials, else slices of whole
    chunks of 4 groups (the last one shorter where they do not divide K) beside a set for each of a
    block's tiles; None where not even one chunk fits."""
    tiles = mma_tiles(N, epi)
    blocks = tiles if epi == 3 else stream_blocks(tiles)   # the QKV phase's blocks complete heads
    ng = K // 64
    if mma_tile8(N, epi):   # x read from global memory, nothing staged
        return ng, 1, blocks
    if ng * M * _MMA_GROUP_ROW_BYTES + _MMA_PARTIALS <= MMA_STAGE_MAX_BYTES:
        return ng, 1, blocks
    tpb = -(-tiles // blocks)
    most = (MMA_STAGE_MAX_BYTES - tpb * _MMA_PARTIALS) // (M * _MMA_GROUP_ROW_BYTES) // 4 * 4
    if most < 4:
        return None
    slices = -(-ng // most)
    return -(-ng // (4 * slices)) * 4, tpb, blocks


def mma_stage_bytes(M, N, epi, plan):
    """Dynamic shared memory of gemv_mma.cu: a slice of x in the mma's k order (2 bytes a value) and
    each of its groups and rows' fp32 sum x (TILE8: none), and the warps' partials."""
    ks, tpb, _ = plan
    return (0 if mma_tile8(N, epi) else ks * M * _MMA_GROUP_ROW_BYTES) + tpb * _MMA_PARTIALS


def mma_takes(dtype, M, K, N, bits, gs, epi, bias, room, head_dim=0, large=False):
    """Whether a phase of the one-launch layer runs gemv_mma.cu (else gemv.cu). EPI 3 (QKV, heads of
    head_dim): in a large layer, where a head is whole tiles of 16 rows; the only one that may carry a
    bias."""
    if epi == 3 and (head_dim % 16 or not large):
        return False
    return (epi in (1, 2, 3) and dtype in HALF and bits == 4 and gs == 64 and (epi == 3 or not bias) and K % 256 == 0
            and M <= 8 and room and (epi == 2 or M >= MMA_MIN_ROWS or 2 * mma_tiles(N, epi) > RESIDENT_BLOCKS)
            and mma_plan(M, K, N, epi) is not None)


def mma_defines(dtype, M, N, epi, eps, plan, head=None, bias=False):
    """#defines of a gemv_mma.cu phase of mma_plan's plan (EPI 3: with the head epilogue's, and
    HAS_BIAS: the only phase whose source adds a bias)."""
    if bias and head is None:
        raise ValueError("gemv_mma.cu adds a bias only in the QKV phase (EPI 3, with its head epilogue)")
    ks, tpb, blocks = plan
    d = dict(M=M, NW=_MMA_WARPS, EPI=epi, TILE8=mma_tile8(N, epi), HAS_NORM=eps is not None, KS=ks, TPB=tpb,
             MMA_BF16=dtype == mx.bfloat16, STREAM=blocks if blocks < mma_tiles(N, epi) else 0)
    if eps is not None:
        d["EPS"] = flt(eps)
    if head is not None:
        d.update(head_defines(head), HAS_BIAS=bias)
    return d


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
        names += ["off"] + (["lp"] if head.get("lpad") else []) + (["rf"] if head["freqs"] else [])
        names += cache_inputs(head) + ["cnt", "after"]
    return names


def gemv_defines(dtype, M, bits, gs, epi, vec, R, nw, eps=None, bias=False, head=None, stage=(0, 0), stream=0):
    """#defines of one GEMV kernel (K and N are run-time values, read from w's shape).
    eps: the folded input RMSNorm's epsilon (None: no norm); stage: x_stage's (XK, XT); stream: STREAM
    (blocks running row groups in turn; 0: one group each)."""
    d = dict(BITS=bits, GS=gs, M=M, R=R, NW=nw, VEC=vec, EPI=epi, XK=stage[0], XT=stage[1], HAS_NORM=eps is not None,
             HAS_BIAS=bias, STREAM=stream)
    if eps is not None:
        d["EPS"] = flt(eps)
    if head is not None:
        d.update(head_defines(head))
    return d


def gemv_outputs(epi):
    return ["yq", "ys"] if epi == 3 else ["y"]


def gemv_blocks(N, epi, R, nw):
    """Blocks of one GEMV launch: NW warps of R output rows each (gate/up: N/2 output rows)."""
    nout = N // 2 if epi == 2 else N
    return -(-nout // (R * nw))


@cached_builder
def _gemv_build(dtype, M, bits, gs, epi, eps, bias, res, head_items, vec, R, nw, stage):
    head = dict(head_items) if head_items else None
    src = source("gemv.cu", gemv_defines(dtype, M, bits, gs, epi, vec, R, nw, eps, bias, head, stage), dtype)
    return cuda_kernel(name=kernel_name("gemv", src), input_names=gemv_inputs(eps is not None, bias, res, head),
                       output_names=gemv_outputs(epi), source=src, ensure_row_contiguous=(epi != 3),
                       shared_memory=x_stage_bytes(M, bits, vec, stage))


def gemv_kernel(dtype, M, K, N, bits, gs, epi, eps, bias, res, head_items):
    """(kernel, grid, threadgroup) of a GEMV launched alone, for this call's sizes; eps: folded
    input RMSNorm or None; head_items: EPI 3's head description (sorted items) or None."""
    VEC, R, NW = gemv_config(M, K, N, bits, epi)
    kern = _gemv_build(dtype, M, bits, gs, epi, eps, bias, res, head_items, VEC, R, NW,
                       x_stage(M, K, dtype, bits, VEC))
    return kern, (gemv_blocks(N, epi, R, NW) * NW * 32, 1, 1), (NW * 32, 1, 1)


def gemv(x2d, w, epi=0, norm=None, res=None):
    """x2d [M, K] -> y [M, N or N/2] (EPI 0-2); `norm` = (weight, eps float) folds an input RMSNorm,
    `res` [M, N] is EPI 1's residual."""
    M, K = x2d.shape
    N = w.out_features
    dtype = x2d.dtype
    bias = w.bias is not None and epi == 0
    kern, grid, tg = gemv_kernel(dtype, M, K, N, w.bits, w.group_size, epi,
                                 None if norm is None else float(norm[1]), bias, res is not None, None)
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
    if dtype not in CTYPE:
        return f"dtype {dtype}"
    if in_features % 32:
        return f"in_features {in_features} not a multiple of 32"
    return None


def unsupported_qkv_proj(**info):
    return _unsupported_linear(**info)


def unsupported_lm_head(**info):
    return _unsupported_linear(**info)


def unsupported_linear(**info):
    if info["dtype"] == mx.float32 and prefill.tf32_matmul():
        return "float32 matmuls run in TF32 here (MLX_ENABLE_TF32=0: in float32): stock quantized_matmul"
    return _unsupported_linear(**info)


def unsupported_gate_up_silu(**info):
    return _unsupported_linear(**info) or ("bias on gate/up" if info.get("bias") else None)


def linear(x, w):
    """x @ W^T for rows the GEMV does not take, and o_proj / down_proj outside the one-launch
    layer at any row count: prefill-sized calls through dense matmuls on dequantised weights
    (prefill.py), 9-64 rows on tensor cores (qmm.py), the rest stock quantized_matmul (as a
    single op the GEMV lost to it on the H200: 0.45-0.8x at decode B=1 for Qwen3-0.6B/4B's o_proj
    and down, timed by the tuner's probes on 2026-12-01)."""
    M = rows(x)
    if prefill.takes(x, w):
        return prefill.linear(x, w)
    if M > MAX_ROWS and qmm.takes(x, w):
        return qmm.qmm(x, w)
    return reference.linear(x, w)


def qkv_proj(x, w):
    M = rows(x)
    nq, nk, nv = w.splits
    if M > MAX_ROWS or x.dtype != w.scales.dtype:
        return tuple(mx.split(linear(x, w), [nq, nq + nk], axis=-1))
    y = gemv(x.reshape(M, -1), w)
    lead = x.shape[:-1]
    return (y[:, :nq].reshape(*lead, nq), y[:, nq:nq + nk].reshape(*lead, nk),
            y[:, nq + nk:].reshape(*lead, nv))


def gate_up_silu(x, w):
    M = rows(x)
    if M > MAX_ROWS and qmm.takes(x, w):
        return qmm.qmm(x, w, epi=2)
    if M > MAX_ROWS or x.dtype != w.scales.dtype:
        gate, up = mx.split(linear(x, w), 2, axis=-1)
        return swiglu(gate, up)
    return gemv(x.reshape(M, -1), w, epi=2).reshape(*x.shape[:-1], w.splits[0])


def lm_head(x, w):
    # 2-64 rows (batched decode) on tensor cores: the GEMV's per-row work grows with the rows (H200,
    # GPU time per call at 2 / 4 / 8 rows, GEMV vs qmm: Qwen3-0.6B's head 74 / 103 / 219 vs 48 / 50 /
    # 52 us, Qwen3-8B's 246 / 405 / 761 vs 214 / 219 / 225; at 1 row the GEMV's 46 / 144 vs 48 / 207),
    # and stock quantized_matmul is slower still from 9 (half of a 32-row Qwen3-4B step:
    # docs/cuda-design.md). Prefill stays stock: the output is the whole vocabulary for every
    # prompt row, and a transient dense weight of the vocabulary is larger than any layer's.
    M = rows(x)
    if M >= HEAD_QMM_FROM and qmm.takes(x, w):
        return qmm.qmm(x, w)
    if not w.quantized or M > MAX_ROWS or x.dtype != w.scales.dtype:
        return reference.lm_head(x, w)
    return gemv(x.reshape(M, -1), w).reshape(*x.shape[:-1], w.out_features)
