"""FastBlock: one decoder block's fused decode path: layer.py's one launch for up to MAX_ROWS rows,
five launches (`wide`, qmm on tensor cores) from MAX_ROWS + 1 to QMM_MAX_ROWS rows (batched decode).
Up to MAX_ROWS rows the one launch won on Qwen3-0.6B and 4B and tied on 8B (H200, BatchGenerator, tg64
after 256 tokens, `cuda_ab.py --set`): with wide from 5 rows on large layers instead, Qwen3-4B at 6 / 8
rows ran 1951 / 1621 tok/s vs 2158 / 2451 through the one launch, Qwen3-8B 1533 / 1982 vs 1550 / 1965."""

import math

import mlx.core as mx
import mlx.nn as nn

from ...ops.weights import PackedLinear, adapter_of
from .attention import MAX_GQA, attention, head_subgroup
from .cache import StaticKVCache, StaticQuantizedKVCache
from .head import cache_inputs
from .layer import LAYER_GROUPS, layers_launch, queue_offset
from .qmm import QMM_MAX_ROWS, head_tickets, norm_tickets, qmm, qmm_head, takes_weight
from .source import HALF, MAX_ROWS, offset_array, tickets

# Several layers per launch (step.launch_runs) win on small layers (Qwen3-0.6B 15M weights per
# layer (M = 2^20), Llama-3.2-1B 58M: 1.25-1.4x decode on the H200) at every row count; on large
# ones (Qwen3-4B 96M, 8B 184M) only at one row (8B lost 1-6% at 4 and 8 rows: docs/cuda-design.md),
# hence the bound. A layer over it shares a launch only in steps of up to step.LARGE_SHARED_MAX_ROWS
# rows; its QKV phase runs on tensor cores from 2 rows, and at one row where its tiles fill more
# than half the wave, and its GEMV phases send no rows to L2 before their wait (layer_build's `large`).
GROUP_MAX_WEIGHTS = 64 << 20


def _quant_ok(m):
    return (isinstance(m, nn.QuantizedLinear) and getattr(m, "mode", "affine") == "affine"
            and m.bits in (4, 8) and m.group_size in (32, 64, 128) and "bias" not in m)


def _as_packed(m):
    K = m.weight.shape[1] * 32 // m.bits
    return PackedLinear(m.weight, m.scales, m.biases, None, (m.weight.shape[0],), K, m.bits, m.group_size)


class FastBlock:
    """The fused decode path of one FusedBlock: for B * L <= MAX_ROWS rows over a StaticKVCache,
    the block as one launch (shared with the following blocks in the compiled step: step.launch_runs);
    else None, and the FusedBlock takes its composed path. The compiled step also
    runs decode steps of MAX_ROWS + 1 to wide_rows rows through `wide`."""

    cache_types = (StaticKVCache, StaticQuantizedKVCache)

    def __init__(self, block):
        attn, mlp = block._attention, block._mlp
        # The FusedBlock and its Watch: the compiled step runs only while the watch is fast and
        # the model's layers are still these blocks (step._compiled_call).
        self.owner, self.watch = block, block.watch
        self.qkv = attn.qkv_weights
        self.gate_up = mlp.gate_up_weights
        self.o = _as_packed(attn._o)
        self.down = _as_packed(mlp._down)
        self.H, self.HKV = attn.n_heads, attn.n_kv_heads
        self.D = self.qkv.splits[0] // self.H
        self.scale = float(attn.scale)
        self.dtype = self.qkv.scales.dtype
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
        # this block's own tickets (the QKV head epilogue: per q/k/v head and token block of `wide`;
        # attention: per row, kv head and head subgroup)
        self.head_tickets = tickets(head_tickets(self.H, self.HKV))
        self.attn_tickets = tickets(MAX_ROWS * self.H)
        self._counters = {}   # layer launches' group counters and tile queues, per layers per launch
        self.weights = sum(w.in_features * w.out_features for w in (self.qkv, self.gate_up, self.o, self.down))
        self.gb = head_subgroup(self.H // self.HKV)   # query heads per attention block
        # `wide` takes decode steps of up to QMM_MAX_ROWS rows where qmm takes all four weights
        self.wide_rows = QMM_MAX_ROWS if all(takes_weight(w, self.dtype) for w in (self.qkv, self.o, self.gate_up,
                                                                                  self.down)) else MAX_ROWS
        self.wide_tickets = tickets(QMM_MAX_ROWS * self.H) if self.wide_rows > MAX_ROWS else None
        self.norm_tickets = tickets(norm_tickets()) if self.wide_rows > MAX_ROWS else None
        self.grouped = self.weights <= GROUP_MAX_WEIGHTS   # shares a launch with its neighbours at any row count
        mx.eval(self.in_norm[0], self.post_norm[0], self.qk, self.rf)

    def __deepcopy__(self, memo):
        # A copy of the model has a stale Watch and builds FastBlocks of its own arrays first.
        return None

    @staticmethod
    def unsupported(block):
        """Why a FusedBlock cannot take the fast path, or None."""
        attn, mlp = block._attention, block._mlp
        qkv = getattr(attn, "qkv_weights", None)
        gu = getattr(mlp, "gate_up_weights", None)
        rope = getattr(attn, "rope_spec", None)
        if qkv is None or not qkv.quantized:
            return "QKV not fused / not quantised"
        if gu is None or not gu.quantized:
            return "gate/up not fused / not quantised"
        if qkv.group is not None or gu.group is not None:
            # o_proj / down_proj end in an all-reduce across ranks, which the one-launch layer
            # (phases 3 and 5) has no place for: the block runs the fused ops between mlx-lm's all_sums.
            ranks = (qkv.group or gu.group).size()
            return f"tensor-parallel shards of a {ranks}-rank group (the one-launch layer has no all-reduce)"
        lora = [n for n, m in zip(("q", "k", "v", "gate", "up"), attn.adapters + mlp.adapters) if m is not None]
        lora += [n for n, m in (("o", attn._o), ("down", mlp._down)) if adapter_of(m)[1] is not None]
        if lora:
            return f"LoRA adapters on {'/'.join(lora)} (the one-launch layer has no low-rank term)"
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
        if qkv.scales.dtype not in HALF:
            return f"dtype {qkv.scales.dtype}"
        if type(block._input_norm) is not nn.RMSNorm or type(block._post_norm) is not nn.RMSNorm:
            return "norm type"
        norms = [block._input_norm, block._post_norm]
        norms += [attn._q_norm, attn._k_norm] if getattr(attn, "has_qk_norm", False) else []
        if any(n.weight.dtype != qkv.scales.dtype for n in norms):
            return "norm weights not in the layers' dtype (the kernels read them as it)"
        for w in (qkv, gu):
            if w.in_features % 32:
                return "in_features not a multiple of 32"
        return None

    def supports(self, x):
        B, L, _ = x.shape
        return B * L <= MAX_ROWS and x.dtype == self.dtype

    def core(self, x, off, *bufs):
        """x [B, L, K], off int32[OFF_WORDS] (cache length before these tokens in [0]), bufs: the
        cache's fast_inputs() -> (block output, the attention output: the new last reader of the
        cache). Writes this step's k/v rows into the cache in place, after the kernel that output
        `after` (the previous reader: bufs' last)."""
        return layers_launch([self], x, off, [bufs])

    def wide(self, x, xn, next_norm, off, kc, vc, after, lp=None):
        """core() for a decode step (L = 1) of MAX_ROWS + 1 to wide_rows rows, from x and xn (x through
        this block's input RMSNorm: the previous block's down made it): QKV on tensor cores with
        q/k norm + RoPE + the k/v cache write in its epilogue (qmm_head), attention (attention.cu),
        o_proj + residual with the post-attention RMSNorm of its rows (qmm), gate/up + SiLU (qmm),
        down + residual with next_norm's (the next block's input RMSNorm (weight, eps), or the
        final norm's; None: none): the composed ops' rounding points, five launches. Returns
        (output, output normalised or None). lp: a batch cache's left padding. The cache's next
        reader must be the output, not the attention's: o_proj and down reuse one ticket buffer
        step after step, and only a reader after them orders the next step's kernels after theirs
        (steps built lazily, as teacher forcing builds them, are not otherwise ordered)."""
        B, L, _ = x.shape
        head = self.head + (("L", L),) + ((("lpad", True),) if lp is not None else ())
        arrays = dict(off=off, lp=lp, kc=kc, vc=vc, after=after, **self.head_arrays())
        q = qmm_head(xn, self.qkv, head, arrays, self.head_tickets)
        o = attention(q, kc, vc, off, self.scale, cnt=self.wide_tickets, gb=self.gb, lp=lp)
        h, hn = qmm(o.reshape(B, L, -1), self.o, epi=1, res=x, norm=self.post_norm, cnt=self.norm_tickets)
        g = qmm(hn, self.gate_up, epi=2)
        if next_norm is None:
            return qmm(g, self.down, epi=1, res=h), None
        return qmm(g, self.down, epi=1, res=h, norm=next_norm, cnt=self.norm_tickets)

    def layer_counters(self, nlayers):
        """Zeroed counters of a launch of nlayers layers led by this block (left zero): a counter per
        group, then from layer.queue_offset a tile queue per group (gemv_mma.cu's TILE_QUEUE)."""
        c = self._counters.get(nlayers)
        if c is None:
            c = self._counters[nlayers] = tickets(queue_offset(nlayers) + LAYER_GROUPS * nlayers)
        return c

    def layer_arrays(self, j, head, bufs):
        """This block's inputs of a layer launch, as layer j (names of layer.layer_build); head: the
        launch's head description, bufs: the cache's fast_inputs() (its arrays, `after`, a batch
        cache's left padding)."""
        qkv, o, gu, dn = self.qkv, self.o, self.gate_up, self.down
        a = {"qkv_w": qkv.weight, "qkv_sc": qkv.scales, "qkv_bi": qkv.biases, "in_nw": self.in_norm[0],
             "o_w": o.weight, "o_sc": o.scales, "o_bi": o.biases,
             "gu_w": gu.weight, "gu_sc": gu.scales, "gu_bi": gu.biases, "post_nw": self.post_norm[0],
             "dn_w": dn.weight, "dn_sc": dn.scales, "dn_bi": dn.biases}
        a.update(zip(cache_inputs(head) + ["after", "lp"], bufs))
        if qkv.bias is not None:
            a["qkv_bias"] = qkv.bias
        a.update(self.head_arrays())
        return {f"{k}{j}": v for k, v in a.items()}

    def head_arrays(self):
        """The head epilogue's model arrays (cuda/head.cuh): q/k norm weights, RoPE frequencies."""
        a = dict(zip(("qn", "kn"), self.qk))
        if self.rf:
            a["rf"] = self.rf[0]
        return a

    def launch_key(self):
        """What must agree for blocks to share a launch (everything but the weights and caches)."""
        ws = tuple((w.bits, w.group_size, w.out_features, w.in_features, w.bias is not None)
                   for w in (self.qkv, self.o, self.gate_up, self.down))
        return (self.dtype, ws, self.in_norm[1], self.post_norm[1], self.head, self.scale, self.gb)

    def __call__(self, x, cache):
        if not self.supports(x):
            return None
        B, L, _ = x.shape
        if not cache.takes(B, self.HKV, self.D, x.dtype):
            return None
        prev = cache.offset
        cache.reserve(B, self.HKV, self.D, x.dtype, prev + L)
        out, cache.last_reader = self.core(x, offset_array(prev), *cache.fast_inputs())
        cache.offset = prev + L
        return out
