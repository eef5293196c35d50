"""q/k RMSNorm + RoPE and the cache write of a QKV projection's rows (cuda/head.cu): the epilogue
of the decode GEMV's EPI 3 (cuda/head.cuh) as a launch of its own, after qmm's rows (FastBlock.wide).

    q[b, l, h] = rope(norm_q(qkv[b, l, q_h]), p),  k likewise into kc[b, :, off + l],
    v[b, l, h] = qkv[b, l, v_h] into vc[b, :, off + l],   p = off + l (- left padding of row b)
    over a quantised cache (head "kv" = (bits, group size)): k and v quantised as mx.quantize does on
    this backend into the packed k_w / k_s / k_b, v_w / v_s / v_b instead

norm_q, norm_k: the q/k RMSNorm where the model has one (Qwen3). The k/v rows are written into the
cache buffers in place (MLX does not see it): the kernel takes the buffers' last reader as an input.
"""

import mlx.core as mx

from ...kernels import cached_builder, cuda_kernel
from .source import flt, kernel_name, source


def head_defines(head):
    """#defines of the head epilogue (cuda/head.cuh) for a FastBlock's head description + L, lpad."""
    d = dict(L=head["L"], H=head["H"], HKV=head["HKV"], D=head["D"], HAS_QKNORM=head["qknorm"],
             QEPS=flt(head["qeps"]), KEPS=flt(head["keps"]), ROPE_TRAD=head["trad"],
             ROPE_FREQS=head["freqs"], ROPE_LOG2_BASE=flt(head["log2_base"]), ROPE_SCALE=flt(head["scale"]))
    if head.get("lpad"):
        d["LEFT_PAD"] = 1
    if head.get("kv"):
        d["KV_BITS"], d["KV_GS"] = head["kv"]
    return d


def cache_inputs(head):
    """The cache arrays the head epilogue writes and the attention reads (by strides): the float
    buffers, or a quantised cache's packed words, scales and biases of keys and of values."""
    return ["k_w", "k_s", "k_b", "v_w", "v_s", "v_b"] if head.get("kv") else ["kc", "vc"]


def head_inputs(head):
    names = ["qkv"] + (["qn", "kn"] if head["qknorm"] else []) + ["off"]
    return names + (["lp"] if head.get("lpad") else []) + (["rf"] if head["freqs"] else []) + cache_inputs(head) + ["after"]


@cached_builder
def _head_build(dtype, head_items):
    head = dict(head_items)
    src = source("head.cu", head_defines(head), dtype)
    return cuda_kernel(name=kernel_name("head", src), input_names=head_inputs(head), output_names=["yq"],
                       source=src, ensure_row_contiguous=False)


def head_rows(qkv, head_items, arrays):
    """qkv [B, L, (H + 2 Hkv) * D] (contiguous) -> q [B, L, H, D]; writes k/v into the cache arrays
    (cache_inputs(head): arrays["kc"] / arrays["vc"], or a quantised cache's) at off[0] + l. head_items: a FastBlock's head description + ("L", L) (+ ("lpad",
    True) over a batch cache); arrays: the other inputs of head_inputs by name."""
    head = dict(head_items)
    B, L, _ = qkv.shape
    H, HKV = head["H"], head["HKV"]
    kern = _head_build(qkv.dtype, tuple(sorted(head_items)))
    inputs = [qkv if n == "qkv" else arrays[n] for n in head_inputs(head)]
    return kern(inputs=inputs, output_shapes=[(B, L, H, head["D"])], output_dtypes=[qkv.dtype],
                grid=((H + 2 * HKV) * 32, B * L, 1), threadgroup=(32, 1, 1))[0]
