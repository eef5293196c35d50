"""The head epilogue of a QKV projection (cuda/head.cuh): the decode GEMV's EPI 3 inside the
one-launch layer, and qmm's EPI 3 (qmm.qmm_head, FastBlock.wide).

    q[b, l, h] = rope(norm_q(qkv[b, l, q_h]), p),  k likewise into kc[b, :, off + l],
    v[b, l, h] = qkv[b, l, v_h] into vc[b, :, off + l],   p = off + l (- left padding of row b)
    over a quantised cache (head "kv" = (bits, group size)): k and v quantised as mx.quantize does on
    this backend into the packed k_w / k_s / k_b, v_w / v_s / v_b instead

norm_q, norm_k: the q/k RMSNorm where the model has one (Qwen3). The k/v rows are written into the
cache buffers in place (MLX does not see it): the kernel takes the buffers' last reader as an input.
"""

from .source import flt


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
    """The epilogue's inputs beside the projection, in qmm_head's order: q/k norm weights, offsets,
    left padding, RoPE frequencies, the cache arrays, their last reader."""
    names = (["qn", "kn"] if head["qknorm"] else []) + ["off"]
    return names + (["lp"] if head.get("lpad") else []) + (["rf"] if head["freqs"] else []) + cache_inputs(head) + ["after"]
