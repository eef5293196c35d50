"""The decoder layer as one launch: its five phases as five consecutive groups of blocks.

  1. input RMSNorm + QKV GEMV + q/k RMSNorm + RoPE + k/v written into the cache (gemv.cu, EPI 3)
  2. attention over the cache buffers, split over the sequence (attention.cu; over a quantised
     cache, quantized_attention.cu, which the QKV phase's epilogue writes as mx.quantize would)
  3. o_proj GEMV + residual add (gemv.cu, EPI 1)
  4. post-attention RMSNorm + gate/up GEMV + SiLU * up (gemv.cu, EPI 2)
  5. down GEMV + residual add (gemv.cu, EPI 1)
  (GEMV phases on tensor cores, gemv_mma.cu, where gemv.mma_takes: gate/up at any rows; o_proj,
  down and, on large layers, QKV from MMA_MIN_ROWS rows and at one row where their tiles fill over
  half the wave)

A block of group g waits for every block of group g - 1 (cuda/layer.cuh) after it has started
loading what does not depend on it (its weights; the attention's cached K/V rows): gemv.cu,
gemv_mma.cu, attention.cu and quantized_attention.cu wait inside (WAIT_INPUTS). Several
consecutive layers of one shape can share a launch (5 groups per layer; step.launch_runs decides):
each phase then has one call site whose blocks pick their layer's inputs at run time, so the code,
and its float arithmetic, is the one-layer launch's for any number of layers (with one call site per
layer NVRTC outlined some phases of long launches, and those copies rounded differently).

Each phase is its kernel file compiled as `__device__ void layer_<phase>(int blk, ...)` with its own
defines (BLOCK_X... = the block's coordinates within its group). The per-layer dispatch (which
phase a block runs, and in a multi-layer launch which layer's inputs) is generated here: MLX's
cuda_kernel takes one source string and names the inputs' shape and stride parameters itself.
"""

import mlx.core as mx

from ...kernels import cached_builder, cuda_kernel, read_source
from .attention import attn_defines, attn_partials
from .gemv import (BLOCKS_PER_SM, gemv_blocks, gemv_config, gemv_defines, gemv_inputs, gemv_outputs, mma_defines,
                   mma_plan, mma_stage_bytes, mma_takes, mma_tiles, stream_blocks, x_stage, x_stage_bytes)
from .head import cache_inputs
from .phases import STAMP_COLS, layer_sets
from .source import CTYPE, STANDALONE, kernel_name, source

LAYER_GROUPS = 5   # QKV head, attention, o_proj, gate/up, down
# Rows of a chunk that the attention phase sends to L2 before its wait, once a chunk (attention.cu,
# quantized_attention.cu): the whole chunk sent by each of its blocks decoded 4-5% slower after 8192
# tokens over a float cache, up to 1.5% over a quantised one (design doc, "Fewer K/V rows sent to L2
# before the wait").
ATTN_PREFETCH_ROWS = 64


def queue_offset(nlayers):
    """Where a launch of nlayers layers keeps its tile queues in its counters: past the group
    counters, from a 128-byte line of their own (the waits poll the group counters' line with plain
    loads, which would queue behind the queues' atomics); the counters are offset + a queue a group."""
    return -(-LAYER_GROUPS * nlayers // 32) * 32


_PTYPES = {"w": "const uint32_t*", "k_w": "const uint32_t*", "v_w": "const uint32_t*", "off": "const int32_t*", "lp": "const int32_t*", "cnt": "const int32_t*",
           "ctr": "const int32_t*", "rf": "const float*", "wait_g": "int", "wait_n": "int",
           "ys": "float*", "pm": "float*", "po": "float*", "stamps": "int64_t*"}
_WAITS = ["ctr", "wait_g", "wait_n"]   # WAIT_INPUTS' parameters: the counter, the group, its blocks


def _phase(fname, filename, defines, dtype, inputs, outputs, shaped=(), strided=()):
    """A kernel file as `__device__ void fname(int blk, ...)`; parameters in MLX's naming."""
    T = CTYPE[dtype]
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


def _phase_args(x, out, w, bias, head, stamps):
    """[(function, arguments)] of one layer's phases; (base, kind) stands for the layer's own input
    `base` (kind "": the array, "_shape" / "_strides": its shape / strides). w(p): WAIT_INPUTS'
    arguments of phase p; stamps: every phase also takes the stamps (its marks)."""
    P = lambda base, kind="": (base, kind)
    lp = [P("lp")] if head.get("lpad") else []   # a batch cache's left padding, per layer
    qkv = [x, P("qkv_w"), P("qkv_w", "_shape"), P("qkv_sc"), P("qkv_bi"), P("in_nw")]
    qkv += ([P("qkv_bias")] if bias else []) + ([P("qn"), P("kn")] if head["qknorm"] else []) + ["off"] + lp
    cache = [a for n in cache_inputs(head) for a in (P(n), P(n, "_strides"))]
    qkv += ([P("rf")] if head["freqs"] else []) + cache + ["head_cnt", P("after")]
    st = ["stamps"] if stamps else []
    return [("layer_qkv", qkv + w(0) + ["yq", "ys"] + st),
            ("layer_attn", ["yq", *cache, "off", *lp, "attn_cnt"] + w(1) + ["o", "pm", "po"] + st),
            ("layer_o", ["o", P("o_w"), P("o_w", "_shape"), P("o_sc"), P("o_bi"), x] + w(2) + ["h"] + st),
            ("layer_gate_up", ["h", P("gu_w"), P("gu_w", "_shape"), P("gu_sc"), P("gu_bi"), P("post_nw")] + w(3)
             + ["a"] + st),
            ("layer_down", ["a", P("dn_w"), P("dn_w", "_shape"), P("dn_sc"), P("dn_bi"), "h"] + w(4) + [out] + st)]


@cached_builder
def layer_build(dtype, M, shapes, eps_in, eps_post, bias, head_items, nsplit, scale, gb, nlayers=1, stamps=False,
                large=False):
    """nlayers consecutive layers (same shapes) as one launch. Returns (kernel, blocks per group,
    input names).

    shapes: ((bits, gs, N, K) of qkv, o, gate_up, down). gb: the attention's query heads per block.
    stamps: an extra output with each block's entry and end times and its marks (layer_stamp,
    layer_mark: every phase compiled with PHASE_MARKS). Inputs of layer j
    carry the suffix j (x, off, the tickets and the counters are shared); layer j > 0 reads the
    previous layer's output from the scratch outputs r0/r1 (alternating), the last layer writes
    `out`. large: layers over block.GROUP_MAX_WEIGHTS (gemv.mma_takes: their QKV phase on tensor
    cores from 2 rows, and at one row where its tiles fill more than half the wave; no GEMV phase
    sends rows to L2 before its wait). A launch of 3 or more layers is capped at 128 registers
    (_layer_kernel)."""
    head = dict(head_items)
    L, H, HKV, D = head["L"], head["H"], head["HKV"], head["D"]
    (qb, qg, qN, qK), (ob, og, oN, oK), (ub, ug, uN, uK), (db, dg, dN, dK) = shapes
    sizes = []   # blocks per phase
    smem = [0]   # dynamic shared memory: the largest of the phases' (staged x; gemv_mma.cu's partials too)
    queued = [False]   # whether a phase takes its tiles from a queue
    header = [read_source("cuda", "layer.cuh")]

    # The launch's static shared memory is the sum of its phases'; attention blocks of more than 256
    # query-head values (GB * D) alone take 20-45 KB, and static + dynamic above 48 KB needs an
    # opt-in that MLX makes only for dynamic sizes above 48000 bytes (else the launch is refused).
    room = gb * D <= 256
    waits = "layer_wait(ctr, wait_g, wait_n)" + ("; layer_mark(stamps, 0)" if stamps else "")
    marks = {"PHASE_MARKS": 1} if stamps else {}
    st = ["stamps"] if stamps else []

    def gemv_phase(name, bits, gs, N, K, epi, eps, has_bias, res, hd):
        if mma_takes(dtype, M, K, N, bits, gs, epi, has_bias, room, hd["D"] if hd else 0, large):
            plan = mma_plan(M, K, N, epi)
            stage_bytes, launched = mma_stage_bytes(M, N, epi, plan), plan[2]
            src, d = "gemv_mma.cu", mma_defines(dtype, M, N, epi, eps, plan, hd, has_bias)
            # A streamed phase whose K is one slice takes the tiles after a block's first from a queue
            # (gemv_mma.cu, TILE_QUEUE) where blocks have 3 or more (with 2, every block takes its second
            # as its first starts: nothing is left to share by speed). An SM's blocks share its memory
            # throughput, so fixed shares ended unevenly: Qwen3-4B's one-row gate/up 17.4 -> 14.4 us,
            # decode 1.03x (8B 1.06x) with the queue (design doc, "Shares by speed").
            if d["STREAM"] and plan[0] * 64 >= K and mma_tiles(N, epi) > 2 * d["STREAM"]:
                d["TILE_QUEUE"] = queue_offset(nlayers)
                queued[0] = True
        else:
            vec, R, nw = gemv_config(M, K, N, bits, epi, one_wave=True)
            stage = x_stage(M, K, dtype, bits, vec, room)
            stage_bytes = x_stage_bytes(M, bits, vec, stage)
            nb = gemv_blocks(N, epi, R, nw)
            launched = stream_blocks(nb) if epi != 3 else nb   # the QKV phase's blocks complete heads
            d = gemv_defines(dtype, M, bits, gs, epi, vec, R, nw, eps, has_bias, hd, stage,
                             launched if launched < nb else 0)
            src = "gemv.cu"
        smem[0] = max(smem[0], stage_bytes)
        d.update(BLOCK_X="blk", BLOCK_Y=0, BLOCK_Z=0, GRID_X=0, WAIT_INPUTS=waits, **marks)
        if large:
            d["NO_EARLY_PREFETCH"] = 1
        header.append(_phase(name, src, d, dtype, gemv_inputs(eps is not None, has_bias, res, hd) + _WAITS,
                             gemv_outputs(epi) + st, shaped=("w",), strided=cache_inputs(head) if hd else ()))
        sizes.append(launched)

    # On large layers no GEMV phase sends rows to L2 before its wait: each phase's blocks enter while
    # the one before runs, and their prefetches cost it more than they sped their own phase (down's
    # took gate/up's bandwidth; o_proj's and gate/up's slowed attention's merge); QKV's delayed the
    # launch's start and, sent during the previous layer's down where large layers share a launch
    # (one-row steps), slowed decode by 3-4% (design doc, "Prefetch before wait").
    gemv_phase("layer_qkv", qb, qg, qN, qK, 3, eps_in, bias, False, head)
    ad = attn_defines(L, H, HKV, D, scale, gb)
    if head.get("lpad"):
        ad["LEFT_PAD"] = 1
    if head.get("kv"):   # the quantised cache's slots past off[0] + l are not positions yet
        ad.update(BITS=head["kv"][0], GS=head["kv"][1], CAUSAL=0, AT_OFFSET=1)
    ys = HKV * ad["G"] // ad["GB"]   # the attention grid's y: kv heads x head subgroups
    ad.update(BLOCK_X=f"(blk % {nsplit})", BLOCK_Y=f"((blk / {nsplit}) % {ys})",
              BLOCK_Z=f"(blk / {nsplit * ys})", GRID_X=nsplit, WAIT_INPUTS=waits, PF_ROWS=ATTN_PREFETCH_ROWS, **marks)
    attn_in = ["q", *cache_inputs(head), "off"] + (["lp"] if head.get("lpad") else []) + ["cnt"]
    header.append(_phase("layer_attn", "quantized_attention.cu" if head.get("kv") else "attention.cu", ad, dtype,
                         attn_in + _WAITS, ["o", "pm", "po"] + st, strided=cache_inputs(head)))
    sizes.append(nsplit * ys * M)
    gemv_phase("layer_o", ob, og, oN, oK, 1, None, False, True, None)
    gemv_phase("layer_gate_up", ub, ug, uN, uK, 2, eps_post, False, False, None)
    gemv_phase("layer_down", db, dg, dN, dK, 1, None, False, True, None)
    assert len(sizes) == LAYER_GROUPS
    groups = sizes * nlayers   # group g = LAYER_GROUPS * layer + phase, each waiting for g - 1
    phase_args = lambda x, out, w: _phase_args(x, out, w, bias, head, stamps)

    own = dict.fromkeys(a[0] for _, args in phase_args("x", "out", lambda p: []) for a in args
                        if not isinstance(a, str) and not a[1])   # a layer's own arrays, in call order
    inputs = ["x", "off", "head_cnt", "attn_cnt", "ctr"] + [f"{b}{j}" for j in range(nlayers) for b in own]
    body = (_loop_body if nlayers > 1 else _one_layer_body)(phase_args, sizes, nlayers, stamps, queued[0])
    return _layer_kernel(header, body, inputs, nlayers, stamps, smem[0]), groups, inputs


def _dispatch(calls, sizes, group, picks, reset, stamps):
    """The body's phase dispatch: a block of phase p (the p-th run of sizes[p] blocks) runs
    calls[p] (after picks(p): lines choosing its layer's inputs), arrives on counter group(p) and
    returns; the last phase ends with the counter reset lines `reset`."""
    lines, last = [], len(calls) - 1
    for p, (n, call) in enumerate(zip(sizes, calls)):
        wrapped = p < last or bool(picks(p))   # one layer's last phase: every block left runs it
        lines += [f"  if (blk < {n}) {{"] if wrapped else []
        lines += picks(p) + [f"    {call};"] + (["    layer_stamp(stamps);"] if stamps else [])
        if p < last:
            lines += [f"    layer_done(ctr, {group(p)});", "    return;", "  }", f"  blk -= {n};"]
        else:
            lines += [f"    {line}" for line in reset] + (["  }"] if wrapped else [])
    return lines


def _one_layer_body(phase_args, sizes, nlayers, stamps, queued):
    """One layer's launch: phase p is counter group p; its inputs carry the suffix 0."""
    w = lambda p: ["ctr", str(p - 1), str(sizes[p - 1] if p > 0 else 0)]   # p = 0: no wait (g < 0)
    name = lambda a: a if isinstance(a, str) else f"{a[0]}0{a[1]}"
    calls = [f"{f}(blk, {', '.join(map(name, args))})" for f, args in phase_args("x", "out", w)]
    last = LAYER_GROUPS - 1
    body = ["  int blk = blockIdx.x;"] + (["  layer_stamp_entry(stamps);"] if stamps else [])
    reset = _counter_reset(last, sizes[last], LAYER_GROUPS, queue_offset(1) if queued else None)
    body += _dispatch(calls, sizes, str, lambda p: [], reset, stamps)
    return "\n".join(body) + "\n"


def _loop_body(phase_args, sizes, nlayers, stamps, queued):
    """A launch of nlayers layers with one call site per phase: each block takes its layer j's
    inputs, picked at run time from the kernel's parameters (the picks name every layer's inputs
    literally: MLX passes an input's strides only where its source names them). Shapes are equal
    across the layers, so layer 0's serve."""
    per = sum(sizes)
    prev = "((j - 1) % 2 == 0 ? r0 : r1)" if nlayers > 2 else "r0"   # r1 exists from 3 layers on
    mine = "(j % 2 == 0 ? r0 : r1)" if nlayers > 2 else "r0"
    body = [f"  int blk = blockIdx.x;",
            f"  const int j = blk / {per};   // the block's layer, and its index within the layer",
            f"  blk -= j * {per};", f"  const int g0 = j * {LAYER_GROUPS};   // the layer's first group"]
    body += ["  layer_stamp_entry(stamps);"] if stamps else []
    body += [f"  const auto xin = j == 0 ? x : {prev};   // the layer's input and output",
             f"  const auto yout = j == {nlayers - 1} ? out : {mine};"]
    before = lambda p: f"g0 - 1" if p == 0 else f"g0 + {p - 1}"   # the group this phase waits for
    # WAIT_INPUTS' arguments (g < 0: the launch's first group, no wait)
    w = lambda p: ["ctr", before(p), str(sizes[(p - 1) % LAYER_GROUPS])]
    kinds = {"": "{}_", "_shape": "{}0_shape", "_strides": "*{}_strides_"}
    calls, picks = [], []
    for f, args in phase_args("xin", "yout", w):
        own = [a for a in args if not isinstance(a, str)]
        names = list(dict.fromkeys(b for b, k in own if not k))
        strided = list(dict.fromkeys(b for b, k in own if k == "_strides"))
        calls.append(f"{f}(blk, {', '.join(a if isinstance(a, str) else kinds[a[1]].format(a[0]) for a in args)})")
        pick = lambda k: " ".join([f"{m}_ = {m}{k};" for m in names] +
                                  [f"{m}_strides_ = &{m}{k}_strides;" for m in strided])
        lines = [f"    auto {m}_ = {m}0;" for m in names] + [f"    auto {m}_strides_ = &{m}0_strides;" for m in strided]
        lines += ["    switch (j) {"] + [f"      case {k}: {pick(k)} break;" for k in range(1, nlayers)] + ["    }"]
        picks.append(lines)
    last = LAYER_GROUPS - 1
    reset = _counter_reset(f"g0 + {last}", sizes[last], LAYER_GROUPS * nlayers,
                           queue_offset(nlayers) if queued else None, f" && j == {nlayers - 1}")
    body += _dispatch(calls, sizes, lambda p: f"g0 + {p}", lambda p: picks[p], reset, stamps)
    return "\n".join(body) + "\n"


def _counter_reset(group, arrivals, counters, queues, only_if=""):
    """CUDA lines ending a launch's last phase: the block that finishes last (the `arrivals`-th
    of group counter `group`, where `only_if` also holds) zeroes the launch's `counters` group
    counters and, from `queues` (None: the launch has none), as many tile queues for the next launch."""
    zero = [f"    for (int i = 0; i < {counters}; ++i) const_cast<int*>(ctr)[i] = 0;"]
    if queues is not None:
        zero.append(f"    for (int i = {queues}; i < {queues + counters}; ++i) const_cast<int*>(ctr)[i] = 0;")
    return ["__syncthreads();",
            "if (threadIdx.x == 0) {   // the last block of the launch resets the counters for the next one",
            f"  if (layer_arrive_last(ctr, {group}) == {arrivals} - 1{only_if}) {{", *zero, "  }", "}"]


def _layer_kernel(header, body, inputs, nlayers, stamps, smem):
    # MLX puts the header before its `namespace mlx::core::cu {` (where Shape and Strides live)
    header = "namespace mlx::core::cu {\n" + "".join(header) + "}  // namespace mlx::core::cu\n"
    outputs = ["out", "yq", "ys", "o", "pm", "po", "h", "a"] + ["r0", "r1"][:min(nlayers - 1, 2)]
    outputs += ["stamps"] if stamps else []
    bounded = nlayers > 2
    name = kernel_name("layer", header + body + f"bounded={bounded}")   # MLX caches modules by name
    if bounded:
        # 3 or more layers in a launch: their per-layer input switch took offline ptxas to 130
        # registers for 3 Qwen3-4B layers at one row and 156 at 4 rows, 150 for 28 Qwen3-0.6B layers
        # and 167 for 16 Llama-3.2-1B layers at 8 rows (3 blocks per SM, not gemv.BLOCKS_PER_SM);
        # capped, 127-128 and no spills (2 large layers fit 128 uncapped, and spill 16-20 bytes at 4
        # rows capped; Qwen2.5-0.5B's 24 at 8 rows spill 32 capped, 1% slower). tests/cuda_compile_check.py
        # requires BLOCKS_PER_SM blocks for these.
        # MLX writes `__global__ void custom_kernel_<name>(`; the macro makes it `__global__ void
        # __launch_bounds__(128, BLOCKS_PER_SM) custom_kernel_<name>(`; the body undefines it.
        k = f"custom_kernel_{name}"
        header += f"#define {k} __launch_bounds__(128, {BLOCKS_PER_SM}) {k}\n"
        body = f"#undef {k}\n" + body
    return cuda_kernel(name=name, input_names=inputs, output_names=outputs,
                       header=header, source=body, ensure_row_contiguous=False, shared_memory=smem)


def attention_splits(fb, M):
    """(splits of the sequence, partials' shapes) of the layer's attention phase at M rows.
    Compiled into the launch, so they do not follow the buffer's length: a batch cache's buffer
    grows by 256 slots, and a server would build a launch per length class mid-service."""
    return attn_partials(M * fb.HKV, None, fb.H // fb.HKV, fb.gb, fb.D)


def ticketed_sets(fb, groups, M):
    """phases.layer_sets of a launch of fb's layers at M rows (groups: its blocks per group)."""
    return layer_sets(groups, fb.H + 2 * fb.HKV, attention_splits(fb, M)[0], LAYER_GROUPS)


def layers_launch(blocks, x, off, bufs, stamps=False):
    """Consecutive decoder layers (block.FastBlock objects with one launch_key) in one launch:
    x [B, L, K] -> (output of the last, the attention scratch output: the new last reader of every
    layer's cache). bufs: per block its cache's fast_inputs(): (kc, vc, after), for a batch cache
    (kc, vc, after, lp: its left padding, int32[max(B, PAD_WORDS)]), for a quantised cache (k_w,
    k_s, k_b, v_w, v_s, v_b, after: head.cache_inputs). With stamps (benchmarks/cuda_layer_phases.py), also
    (int64 [blocks, phases.STAMP_COLS]: each block's entry and end time in ns, its SM and its marks,
    blocks per group in launch order)."""
    fb = blocks[0]
    B, L, K = x.shape
    M = B * L
    qkv, gu = fb.qkv, fb.gate_up
    nsplit, partials = attention_splits(fb, M)
    shapes = tuple((w.bits, w.group_size, w.out_features, w.in_features) for w in (qkv, fb.o, gu, fb.down))
    head = fb.head + (("L", L),) + kv_format(bufs[0], fb.D)
    kern, groups, names = layer_build(x.dtype, M, shapes, fb.in_norm[1], fb.post_norm[1], qkv.bias is not None,
                                      head, nsplit, fb.scale, fb.gb, len(blocks), stamps, not fb.grouped)
    nblocks = sum(groups)
    arrays = {"x": x, "off": off, "head_cnt": fb.head_tickets, "attn_cnt": fb.attn_tickets,
              "ctr": fb.layer_counters(len(blocks))}
    for j, (b, buf) in enumerate(zip(blocks, bufs)):
        arrays.update(b.layer_arrays(j, dict(head), buf))
    f32 = mx.float32
    shapes_out = [(B, L, K), (B, L, fb.H, fb.D), (M, qkv.out_features), (B, L, fb.H, fb.D), *partials, (M, K),
                  (M, gu.out_features // 2)]
    dtypes_out = [x.dtype, x.dtype, f32, x.dtype, f32, f32, x.dtype, x.dtype]
    extra = min(len(blocks) - 1, 2)   # r0, r1: the residual stream between the layers
    shapes_out += [(M, K)] * extra + ([(nblocks, STAMP_COLS)] if stamps else [])
    dtypes_out += [x.dtype] * extra + ([mx.int64] if stamps else [])
    outs = kern(inputs=[arrays[n] for n in names], output_shapes=shapes_out, output_dtypes=dtypes_out,
                grid=(nblocks * 128, 1, 1), threadgroup=(128, 1, 1))
    return (outs[0], outs[3], outs[-1], groups) if stamps else (outs[0], outs[3])


def kv_format(bufs, D):
    """The head description's cache items for a cache's fast_inputs(): a quantised cache's
    ("kv", (bits, group size)) from its packed shapes, a batch cache's ("lpad", True), else none."""
    if bufs[0].dtype == mx.uint32:
        return (("kv", (32 * bufs[0].shape[-1] // D, D // bufs[1].shape[-1])),)
    return (("lpad", True),) if len(bufs) == 4 else ()
