"""Quantised matmul on tensor cores (cuda/qmm.cu) for the rows just past the decode GEMVs: more
than MAX_ROWS, at most QMM_MAX_ROWS (short prompts, speculative verification, the lm_head of
batched decode), and the projections of FastBlock.wide (batched decode steps of those rows).
More rows go to stock quantized_matmul, and from PREFILL_MIN_ROWS (but lm_head's) to the prefill
path (prefill.py).

    y = x @ (s * q + b)^T  (+ bias)          EPI 1: res + that;  EPI 2: swiglu(gate rows, up rows)
    EPI 3 (qmm_head): the QKV projection's y, then head.py's epilogue on it: q/k RMSNorm + RoPE,
    k/v written into the cache

On these rows a GEMM is a weight read: MLX's quantized_matmul reaches 1-81 TFLOP/s on the H200,
dequantise + dense matmul less (benchmarks/results/cuda_prefill.md). Here one weight read serves
the block's 16 tokens, dequantised in registers; the blocks of the other tokens read the same
weights at the same time, from L2.
"""

import mlx.core as mx

from ...kernels import cached_builder, cuda_kernel
from .head import head_defines, head_inputs
from .source import HALF, flt, kernel_name, rows, source

QMM_MAX_ROWS = 64   # more rows: stock quantized_matmul; the tuner judges this path by 64-token chunks
TOKENS_MAX = 16     # tokens per block: 2 mma tiles of 8 (more rows: more blocks, side by side in the grid)
TOKEN_BLOCKS_MAX = -(-QMM_MAX_ROWS // TOKENS_MAX)   # blocks along the tokens of any call
SMEM_FLOATS = 8192  # the warps' partials (NW * 32 rows * 8 * MT tokens floats): 32 KB (EPI 3 adds 8 * MT * D)
WARPS_MIN = 1056    # 8 warps per SM of the H200's 132: split K over more warps below this many
SMS = 132           # the H200's SMs
SM_WARPS = 16       # warps an SM holds at the kernel's 128 registers a thread
MAX_WEIGHT_BLOCKS = 65535   # grid y: CUDA's limit


def chunk_k(bits):
    """KC of qmm.cu: the k a chunk covers (4 lanes x one 16-byte word each)."""
    return 4 * (32 if bits == 4 else 16)


def takes(x, w):
    """Whether the kernel takes x @ w: up to QMM_MAX_ROWS rows of a dtype `takes_weight` takes."""
    return rows(x) <= QMM_MAX_ROWS and takes_weight(w, x.dtype)


def takes_weight(w, dtype):
    """Whether the kernel takes w for activations of `dtype`: 4/8-bit weights, half activations in
    the scales' dtype, K in whole chunks (Qwen3, Llama and Qwen2 hidden and intermediate sizes are),
    the rows in the grid's y (2M: no vocabulary comes near)."""
    return (w.quantized and w.bits in (4, 8) and w.group_size in (32, 64, 128) and dtype in HALF
            and dtype == w.scales.dtype and w.in_features % chunk_k(w.bits) == 0
            and weight_blocks(w.out_features, 0) <= MAX_WEIGHT_BLOCKS)


def weight_blocks(nout, epi):
    """Blocks along the weight rows: 32 rows each (EPI 2: 16 gate rows and their 16 up rows)."""
    return -(-nout // (16 if epi == 2 else 32))


def qmm_config(M, K, NOUT, bits, epi):
    """(MT, NW, weight blocks, token blocks)."""
    MT = min(TOKENS_MAX, -(-M // 8) * 8) // 8
    tokens = -(-M // (8 * MT))
    weights = weight_blocks(NOUT, epi)
    nchunk = K // chunk_k(bits)
    # Up to a whole SM's warps a block where the grid has at most a block per SM (Qwen3-4B/8B's
    # o_proj and down up to 16 rows), else 8: more would leave a partial second wave. The QKV head
    # (EPI 3) keeps 8 in any grid: its epilogue's rows in shared memory beside 16 warps' partials
    # would pass 48 KB at head_dim 256. H200, GPU time per call in the model's batched decode step
    # (cuda_trace, 8 warps vs 16): Qwen3-4B at 4 rows o_proj/down + norm 18.5 -> 15.5 us, 8B at 8
    # rows 23.6 -> 20.7; where the grid is larger more warps lost: the QKV's 192 blocks at 16 warps
    # 12.3 -> 15.8, gate/up at 8 warps (2 here) 18.4 -> 19.2 (4B) and 30.8 -> 31.7 (8B).
    max_warps = SM_WARPS if weights * tokens <= SMS and epi != 3 else SM_WARPS // 2
    NW = 1
    while (NW * 2 <= min(nchunk, max_warps) and 2 * NW * 32 * 8 * MT <= SMEM_FLOATS
           and weights * tokens * NW < WARPS_MIN):
        NW *= 2
    return MT, NW, weights, tokens


@cached_builder
def _qmm_build(dtype, bits, gs, MT, NW, epi, bias, head_items=None, norm_eps=None):
    d = dict(BITS=bits, GS=gs, MT=MT, NW=NW, EPI=epi, HAS_BIAS=bias, MMA_BF16=dtype == mx.bfloat16)
    names = ["x", "w", "sc", "bi"] + (["bias"] if bias else []) + (["res"] if epi == 1 else [])
    outputs = ["y"]
    if epi == 3:
        head = dict(head_items)
        d.update(head_defines(head))
        names += head_inputs(head) + ["cnt"]
        outputs = ["ys", "yq"]
    if norm_eps is not None:
        d["NORM_EPS"] = flt(norm_eps)
        names += ["nw", "cnt"]
        outputs += ["yn"]
    src = source("qmm.cu", d, dtype)
    # EPI 3 writes the cache buffers in place: they must reach it as they are (strides), not copied
    return cuda_kernel(name=kernel_name("qmm", src), input_names=names, output_names=outputs,
                       source=src, ensure_row_contiguous=epi != 3)


def norm_tickets():
    """Tickets qmm's normalised output needs for any call of up to QMM_MAX_ROWS rows: one per
    token block."""
    return TOKEN_BLOCKS_MAX


def qmm(x, w, epi=0, res=None, norm=None, cnt=None):
    """x [..., K] @ W^T (+ bias) (epi 0; with res [..., N], epi 1: res + that), or swiglu of the
    stacked gate/up rows (epi 2), for a quantised PackedLinear that `takes` x. norm (epi 1 only):
    (weight [N], eps) of the RMSNorm that follows: returns (y, rms_norm(y)), the norm made by the
    kernel's last block per 16 tokens; cnt: int32 tickets for it, at least norm_tickets(), zero (left
    zero); fresh ones where None."""
    M, K, N = rows(x), x.shape[-1], w.weight.shape[0]
    nout = N // 2 if epi == 2 else N
    if epi == 2 and w.bias is not None:
        raise ValueError("qmm: no bias on gate/up (unsupported_gate_up_silu refuses it)")
    if (epi == 1) != (res is not None):
        raise ValueError("qmm: a residual goes with epi 1, and only with it")
    if norm is not None and (epi != 1 or N % 32):
        raise ValueError(f"qmm: a normalised output goes with epi 1 (the residual stream) and rows of whole "
                         f"32-element blocks; got epi {epi}, {N} outputs")
    bias = w.bias is not None
    MT, NW, weights, tokens = qmm_config(M, K, nout, w.bits, epi)
    kern = _qmm_build(x.dtype, w.bits, w.group_size, MT, NW, epi, bias, None, None if norm is None else norm[1])
    inputs = [x.reshape(M, K), w.weight, w.scales, w.biases] + ([w.bias] if bias else [])
    inputs += [res.reshape(M, N)] if epi == 1 else []
    if norm is not None:
        inputs += [norm[0], mx.zeros((max(tokens, 4),), dtype=mx.int32) if cnt is None else cnt]
    n = 1 if norm is None else 2
    out = kern(inputs=inputs, output_shapes=[(M, nout)] * n, output_dtypes=[x.dtype] * n,
               grid=(tokens * NW * 32, weights, 1), threadgroup=(NW * 32, 1, 1))
    shaped = [y.reshape(*x.shape[:-1], nout) for y in out]
    return shaped[0] if norm is None else tuple(shaped)


def head_tickets(H, HKV):
    """Tickets qmm_head needs for any decode step of up to QMM_MAX_ROWS rows: one per token block
    and q/k/v head."""
    return TOKEN_BLOCKS_MAX * (H + 2 * HKV)


def qmm_head(x, w, head_items, arrays, cnt=None):
    """x [B, L, K] -> q [B, L, H, D]: the QKV projection x @ W^T (+ bias) of a quantised PackedLinear
    that `takes` x, with the head epilogue of head.py (EPI 3): q/k RMSNorm + RoPE, k/v written into
    the cache arrays at off[0] + l. head_items: a FastBlock's head description + ("L", L) (+
    ("lpad", True)); arrays: head.head_inputs(head) by name; cnt: int32 tickets, at least
    head_tickets(H, HKV), zero (left zero); fresh ones where None. x and the weights reach the
    kernel as they are (the cache arrays must: it writes them in place), so they must be
    row-contiguous, as kernels and loaded weights make them."""
    head = dict(head_items)
    B, L, K = x.shape
    M, N = B * L, w.weight.shape[0]
    H, HKV, D = head["H"], head["HKV"], head["D"]
    if N != (H + 2 * HKV) * D or D % 32:
        raise ValueError(f"qmm_head: {N} weight rows are not {H} + 2 x {HKV} heads of {D} (a multiple of 32)")
    bias = w.bias is not None
    MT, NW, weights, tokens = qmm_config(M, K, N, w.bits, 3)
    if cnt is None:
        cnt = mx.zeros((max(tokens * (H + 2 * HKV), 4),), dtype=mx.int32)
    kern = _qmm_build(x.dtype, w.bits, w.group_size, MT, NW, 3, bias, tuple(sorted(head_items)))
    inputs = [x.reshape(M, K), w.weight, w.scales, w.biases] + ([w.bias] if bias else [])
    inputs += [arrays[n] for n in head_inputs(head)] + [cnt]
    _, q = kern(inputs=inputs, output_shapes=[(M, N), (B, L, H, D)], output_dtypes=[mx.float32, x.dtype],
                grid=(tokens * NW * 32, weights, 1), threadgroup=(NW * 32, 1, 1))
    return q
