"""The one-launch decoder layer (layer.py) against the block it replaces, evaluated in float32 (the
QKV bias on tensor cores too), and its launch rules: GEMV blocking by rows, phases on tensor cores,
launch sizes, attention splits and head subgroups, and the blocking rules forced onto tiny models
keeping the outputs bit for bit. On a machine with MLX's CUDA backend on the GPU (`pytest -m cuda`),
elsewhere through the CPU emulator of tests/cuda_emu (tests/test_cuda_kernels.py says what that
verifies)."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_fastops import kernels
from mlx_fastops.backends.cuda import attention as A
from mlx_fastops.backends.cuda import block, layer
from mlx_fastops.backends.cuda import gemv as G
from mlx_fastops.backends.cuda.source import offset_array

from cuda_checks import rel, unstaged

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("on_gpu")]   # on_gpu: the GPU, else the emulator


@pytest.mark.parametrize("name,batch,L,mma,dtype", [
    ("qwen3-tiny", 1, 1, "", "bfloat16"), ("llama-tiny", 2, 1, "", "bfloat16"), ("qwen2-tiny", 1, 1, "", "bfloat16"),
    ("qwen3-tiny", 2, 3, "", "bfloat16"), ("llama-tiny", 1, 1, "all", "bfloat16"), ("qwen2-tiny", 2, 3, "all", "bfloat16"),
    ("llama-tiny", 2, 1, "all", "float16"), ("llama-tiny", 1, 1, "sliced", "bfloat16"),
    ("llama-tiny", 2, 2, "sliced_stream", "bfloat16"), ("llama-tiny-wide", 2, 1, "all", "float16"),
    ("llama-tiny-wide", 2, 4, "all", "bfloat16"), ("qwen2-tiny-g5", 1, 1, "", "bfloat16"),
    ("qwen2-tiny-g5", 2, 3, "", "bfloat16")])
def test_one_launch_layer_matches_stock_block(name, batch, L, mma, dtype, monkeypatch):
    """One layer's launch (fb.core) against the decoder block it replaces, evaluated in float32
    (dequantised weights, float32 activations) on the same inputs over a KVCache holding the same
    P cached rows: the block's output and the k/v rows written in place into the cache buffers
    (nothing else there moves), no further from float32 than the stock bf16 block (which adds up
    in bf16). Again with x unstaged (the path of rows too long for shared memory): bit for bit the
    default launch's; and with attention blocks of another number of query heads (all G, or 1 where
    the default takes all): the cache bit for bit, the attention output at most one rounding step off
    in at most 1% of its values, the block's output near (the split count and the merge's parts
    follow the heads per block, so the sums run in another order: in half precision a rounding now
    and then lands on the other side). mma "all": every phase that gemv_mma.cu can take runs on it;
    "sliced": so too, with shared memory for one chunk of x at a time (o_proj: K in 2 slices);
    "sliced_stream": and an 8-block wave (o_proj's 16 tiles 2 to a block). In float16 too (gemv_mma.cu's
    E = 1024 and f16 mma). llama-tiny-wide (K 2304): QKV's and gate/up's staging takes two items a
    thread, the first step before the norm at 2 rows, and at 8 rows its later steps."""
    from mlx_lm.models.cache import KVCache
    from mlx_fastops import fidelity, synthetic_model
    import mlx_fastops

    monkeypatch.setenv("MLX_FASTOPS_BACKEND", "cuda")
    dt = getattr(mx, dtype)
    if mma:   # every phase gemv_mma.cu takes (its K a multiple of 256) on tensor cores, whatever its rows
        monkeypatch.setattr(G, "MMA_MIN_ROWS", 1)
        monkeypatch.setattr(block, "GROUP_MAX_WEIGHTS", 0)   # QKV as in a large layer
        if mma != "all":   # shared memory for one chunk of x beside a set of partials per tile
            tpb = 2 if mma == "sliced_stream" else 1
            monkeypatch.setattr(G, "RESIDENT_BLOCKS", 16 // tpb)
            one_chunk = 4 * G._MMA_GROUP_ROW_BYTES * batch * L
            monkeypatch.setattr(G, "MMA_STAGE_MAX_BYTES", tpb * G._MMA_PARTIALS + one_chunk)
        kernels.clear_builders()
    model = synthetic_model(name, bits=4, dtype=dt, seed=2)
    stock = model.model.layers[0]
    mlx_fastops.patch(model, disable=("compile",))
    try:
        fb = model.model.layers[0].fast_fn
        P, D, S = 270, fb.D, 512
        k0 = mx.random.normal((batch, fb.HKV, S, D)).astype(dt)
        v0 = mx.random.normal((batch, fb.HKV, S, D)).astype(dt)
        x = mx.random.normal((batch, L, model.args.hidden_size)).astype(dt)   # L new tokens each

        def run():
            kc, vc = k0 + 0, v0 + 0
            mx.eval(kc, vc)
            out, o = fb.core(x, offset_array(P), kc, vc, kc)
            mx.eval(out, o)
            return out, kc, vc, o

        launched = run()
        variants = []
        if mma:   # gate/up (sliced: o_proj) ran on tensor cores (the variants below would turn it off: other bits)
            M, gu, o = batch * L, fb.gate_up, fb.o
            if mma == "all":
                assert G.mma_takes(dt, M, gu.in_features, gu.out_features, 4, 64, 2, False, True)
                qkv = fb.qkv   # with its head epilogue, and its bias (qwen2-tiny)
                assert G.mma_takes(dt, M, qkv.in_features, qkv.out_features, 4, 64, 3,
                                   qkv.bias is not None, True, fb.D, not fb.grouped)
            else:
                assert G.mma_takes(dt, M, o.in_features, o.out_features, 4, 64, 1, False, True)
                assert G.mma_plan(M, o.in_features, o.out_features, 1) == (4, tpb, 16 // tpb)
        else:
            with unstaged():
                variants = [run()]
            G_ = fb.H // fb.HKV
            fb.gb, gb = (G_ if G_ != fb.gb else 1), fb.gb   # attention blocks of another head count
            other_heads = run()
            fb.gb = gb
        for name_, c in (("group", fb.layer_counters(1)), ("head", fb.head_tickets), ("attention", fb.attn_tickets)):
            assert not np.asarray(c).any(), f"{name_} tickets not reset"
    finally:
        mlx_fastops.unpatch(model)
        kernels.clear_builders()   # no kernel built with the forced tiles outlives the test
    oracle = fidelity.fp32_oracle(synthetic_model(name, bits=4, dtype=dt, seed=2)).model.layers[0]
    f32 = lambda a: a.astype(mx.float32)
    mask = "causal" if L > 1 else None
    ref, ref_cache = [], []
    for blk, cast in ((oracle, f32), (stock, lambda a: a)):
        cache = KVCache()
        cache.update_and_fetch(cast(k0[:, :, :P]), cast(v0[:, :, :P]))
        ref.append(blk(cast(x), mask=mask, cache=cache))
        ref_cache.append(cache)
    out, kc, vc, o = launched
    assert rel(out, ref[0]) <= max(1.1 * rel(ref[1], ref[0]), 1e-2)
    for ours, old, new, stock_new in ((kc, k0, ref_cache[0].keys, ref_cache[1].keys),
                                      (vc, v0, ref_cache[0].values, ref_cache[1].values)):
        rows = lambda a: a[:, :, P:P + L]
        assert rel(rows(ours), rows(new)) <= max(1.1 * rel(rows(stock_new), rows(new)), 1e-2)
        assert mx.array_equal(ours[:, :, :P], old[:, :, :P]) and mx.array_equal(ours[:, :, P + L:], old[:, :, P + L:])
    for variant in variants:
        for a, b in zip(launched, variant):
            assert mx.array_equal(a, b)
    if not mma:   # the attention output at most a rounding step off, in a few places; what follows it near
        assert mx.array_equal(other_heads[1], kc) and mx.array_equal(other_heads[2], vc)
        a, b = (np.asarray(t.astype(mx.float32)).astype(np.float64) for t in (other_heads[3], o))
        _, e = np.frexp(np.maximum(np.abs(a), np.abs(b)))
        steps = np.abs(a - b) / np.ldexp(1.0, e - (8 if dt == mx.bfloat16 else 11))   # ulps of dt
        assert steps.max() <= 1 and (steps > 0).mean() <= 0.01, (steps.max(), (steps > 0).mean())
        assert rel(other_heads[0], out) <= 1e-3


def layer_outputs(fb, x, k0):
    """One layer launch (fb.core) over x at offset 300 of a fresh cache (k0, and 2 k0 as v): its
    outputs, then the cache buffers it wrote into."""
    kc, vc = k0 + 0, k0 * 2
    mx.eval(kc, vc)
    out = fb.core(x, offset_array(300), kc, vc, kc) + (kc, vc)
    mx.eval(out)
    return out


@pytest.mark.parametrize("batch", [2, 8])
def test_qkv_bias_on_tensor_cores_rounds_as_gemv(batch, monkeypatch):
    """Qwen2.5's QKV bias on gemv_mma.cu's head epilogue rounds as gemv.cu's does: T(T(acc) + bias).
    With x = +-1, the input norm's weight 1 and QKV weights (q - 8) / 8, every product and sum of
    either GEMV is exact in fp32, so both reach the same acc whatever their order; the sums need
    more bits than T holds, and the bias as much as they do, so both roundings are exercised. The
    launch with QKV on tensor cores must then equal, bit for bit, the one with QKV on gemv.cu (the
    other phases the same in both)."""
    from mlx_fastops import synthetic_model
    import mlx_fastops

    monkeypatch.setenv("MLX_FASTOPS_BACKEND", "cuda")
    monkeypatch.setattr(G, "MMA_MIN_ROWS", 1)
    monkeypatch.setattr(block, "GROUP_MAX_WEIGHTS", 0)   # QKV as in a large layer
    kernels.clear_builders()
    model = synthetic_model("qwen2-tiny", bits=4, dtype=mx.bfloat16, seed=5)
    blk = model.model.layers[0]
    blk.input_layernorm.weight = mx.ones_like(blk.input_layernorm.weight)
    for proj in (blk.self_attn.q_proj, blk.self_attn.k_proj, blk.self_attn.v_proj):
        proj.scales = mx.full(proj.scales.shape, 0.125, proj.scales.dtype)
        proj.biases = mx.full(proj.biases.shape, -1.0, proj.biases.dtype)
        # as large as the sums, so that T(acc)'s rounding shows through their cancellations
        proj.bias = (8 * mx.random.normal(proj.bias.shape)).astype(proj.bias.dtype)
    mlx_fastops.patch(model, disable=("compile",))
    try:
        fb = model.model.layers[0].fast_fn
        qkv = fb.qkv
        assert qkv.bias is not None and G.mma_takes(mx.bfloat16, batch, qkv.in_features, qkv.out_features, 4, 64,
                                                     3, True, True, fb.D, not fb.grouped)
        x = (2 * mx.random.bernoulli(shape=(batch, 1, qkv.in_features)) - 1).astype(mx.bfloat16)
        k0 = mx.random.normal((batch, fb.HKV, 512, fb.D)).astype(mx.bfloat16)
        on_mma = layer_outputs(fb, x, k0)
        monkeypatch.setattr(layer, "mma_takes", lambda *a, **k: a[6] != 3 and G.mma_takes(*a, **k))
        kernels.clear_builders()
        on_gemv = layer_outputs(fb, x, k0)
    finally:
        mlx_fastops.unpatch(model)
        kernels.clear_builders()
    for a, b in zip(on_mma, on_gemv):
        assert mx.array_equal(a, b)


# Real layer shapes ((bits, gs, N, K) of qkv, o, gate/up, down), heads (H, HKV, D), then the blocks
# of the GEMV phases of one launch at batch 1 (qkv, o, gate/up, down) and whether x is staged.
LAYERS = [
    ("qwen3-0.6b", ((4, 64, 4096, 1024), (4, 64, 1024, 2048), (4, 64, 6144, 1024), (4, 64, 1024, 3072)),
     (16, 8, 128), (512, 256, 384, 256), True),
    ("qwen3-4b", ((4, 64, 6144, 2560), (4, 64, 2560, 4096), (4, 64, 19456, 2560), (4, 64, 2560, 9728)),
     (32, 8, 128), (384, 320, 406, 320), True),
    ("qwen3-8b", ((4, 64, 6144, 4096), (4, 64, 4096, 4096), (4, 64, 24576, 4096), (4, 64, 4096, 12288)),
     (32, 8, 128), (384, 512, 512, 512), True),
    ("llama-3.2-1b", ((4, 64, 3072, 2048), (4, 64, 2048, 2048), (4, 64, 16384, 2048), (4, 64, 2048, 8192)),
     (32, 8, 64), (384, 512, 512, 512), True),
    ("qwen2.5-0.5b", ((4, 64, 1152, 896), (4, 64, 896, 896), (4, 64, 9728, 896), (4, 64, 896, 4864)),
     (14, 2, 64), (144, 224, 304, 224), True),
    ("G 2, D 256", ((4, 64, 4096, 1024), (4, 64, 1024, 2048), (4, 64, 6144, 1024), (4, 64, 1024, 3072)),
     (8, 4, 256), (512, 256, 384, 256), False),   # attention blocks of 512 query-head values
]


@pytest.mark.parametrize("M,configs", [
    (1, ((4, 4), (4, 2), (4, 2), (4, 2))), (2, ((4, 4), (4, 2), (4, 2), (4, 2))),
    (4, ((2, 2), (2, 2), (2, 1), (2, 2))), (8, ((1, 4), (1, 2), (1, 2), (1, 2)))])
def test_layer_gemv_blocking_by_rows(M, configs):
    """(VEC, R) of Qwen3-4B's QKV, o_proj, gate/up and down phases by activation rows: 16-byte lane
    loads (VEC 4) up to 2 rows, then 8 and 4 bytes; beside 8-byte loads of 3-4 rows at most 8
    accumulators (weight rows x rows) per lane, so the launch stays within 128 registers (4 blocks
    per SM; tests/cuda_compile_check.py); from 5 rows on the rows per warp of one row."""
    shapes = LAYERS[1][1]
    got = tuple(G.gemv_config(M, K, N, bits, epi, one_wave=True)[:2]
                for (bits, _, N, K), epi in zip(shapes, (3, 1, 2, 1)))
    assert got == configs


def captured_layer(M, shapes, heads, nsplit, large=False):
    """layer.layer_build's kernel arguments and blocks per phase for a bf16 layer of these shapes and
    (H, HKV, D) heads (Qwen3-style: q/k norms) at M rows over nsplit attention splits, captured:
    nothing is built."""
    H, HKV, D = heads
    head = dict(D=D, H=H, HKV=HKV, L=1, freqs=False, qknorm=True, trad=False, qeps=1e-6, keps=1e-6,
                log2_base=20.0, scale=1.0)
    with kernels.use_cuda_factory(lambda **kw: kw):
        kw, groups, _ = layer.layer_build(mx.bfloat16, M, shapes, 1e-6, 1e-6, False, tuple(sorted(head.items())),
                                          nsplit, 0.088, A.head_subgroup(H // HKV), 1, False, large)
    return kw, groups


@pytest.mark.parametrize("name,M,on_mma", [
    ("qwen3-0.6b", 1, (False, False, True, False)), ("qwen3-0.6b", 2, (False, True, True, True)),
    ("qwen3-4b", 1, (True, True, True, True)), ("qwen3-4b", 2, (True, True, True, True)),
    ("qwen3-8b", 1, (True, True, True, True)), ("qwen3-8b", 4, (True, True, True, True)),
    ("llama-3.2-1b", 1, (False, False, True, False)), ("llama-3.2-1b", 2, (False, True, True, True)),
    ("qwen2.5-0.5b", 4, (False, False, False, True)), ("G 2, D 256", 2, (False, False, False, False))])
def test_layer_phases_on_tensor_cores(name, M, on_mma):
    """Which phases (QKV, o_proj, gate/up, down) gemv_mma.cu takes, as measured (gemv.py): gate/up
    always; o_proj and down from 2 rows, at one row where their tiles fill more than half the wave
    (Qwen3-4B / 8B, not Llama-3.2-1B's 256 or Qwen3-0.6B's 128); QKV so too (Qwen3-4B / 8B: 384
    tiles) in layers of over GROUP_MAX_WEIGHTS where a head is whole tiles of 16 rows; only K a multiple of
    256 and where the attention blocks leave room for staged x (Qwen2.5-0.5B: K 896 but its down's
    4864, with room since its 7 query heads take a block each: attention.head_subgroup)."""
    shapes, (H, HKV, D) = {n: (s, h) for n, s, h, *_ in LAYERS}[name]
    large = sum(N * K for _, _, N, K in shapes) > block.GROUP_MAX_WEIGHTS
    room = A.head_subgroup(H // HKV) * D <= 256   # as layer_build
    got = tuple(G.mma_takes(mx.bfloat16, M, K, N, bits, gs, epi, False, room, D, large)
                for (bits, gs, N, K), epi in zip(shapes, (3, 1, 2, 1)))
    assert got == on_mma
    qkv = shapes[0]
    # a QKV bias (Qwen2.5) rides gemv_mma.cu's head epilogue; no other phase there takes one
    assert G.mma_takes(mx.bfloat16, M, qkv[3], qkv[2], 4, 64, 3, True, room, D, large) == on_mma[0]
    assert not any(G.mma_takes(mx.bfloat16, M, K, N, bits, gs, epi, True, room)
                   for (bits, gs, N, K), epi in zip(shapes[1:], (1, 2, 1)))
    with pytest.raises(ValueError, match="only in the QKV phase"):
        G.mma_defines(mx.bfloat16, M, shapes[1][2], 1, None, (1, 1, 1), bias=True)
    if M == 1 and not large:   # a small model's layers launched one by one (GROUP_MAX_WEIGHTS 0) round as
        # its grouped launch does: QKV's tiles do not fill the wave (test_cuda_models' bitwise test)
        assert not G.mma_takes(mx.bfloat16, 1, qkv[3], qkv[2], 4, 64, 3, False, room, D, True)
    # heads of 72: not whole tiles
    assert not G.mma_takes(mx.bfloat16, 4, qkv[3], qkv[2], 4, 64, 3, False, True, 72, True)
    # the layer built: each phase's source is gemv_mma.cu (mma.sync) exactly where the rule says
    kw, _ = captured_layer(M, shapes, (H, HKV, D), 3, large)
    phases = {p.split("(")[0]: p for p in kw["header"].split("__device__ void layer_")[1:]}
    assert tuple("mma.sync" in phases[p] for p in ("qkv", "o", "gate_up", "down")) == on_mma
    # no GEMV phase of a large layer sends rows to L2 before its wait (design doc)
    early = tuple("#define NO_EARLY_PREFETCH" not in phases[p] for p in ("qkv", "o", "gate_up", "down"))
    assert early == (not large,) * 4
    assert not G.mma_takes(mx.bfloat16, M, *shapes[1][3:1:-1], 8, 64, 1, False, True)   # 8-bit: gemv.cu
    assert not G.mma_takes(mx.bfloat16, M, *shapes[2][3:1:-1], 4, 32, 2, False, True)   # groups of 32


@pytest.mark.parametrize("name,shapes,heads,blocks,staged", LAYERS)
def test_layer_launch_sizes(name, shapes, heads, blocks, staged):
    """How the one-launch layer is cut on the H200 at one row (as measured: docs/cuda-design.md):
    the phases on tensor cores (gemv_mma.cu) a block per tile (o_proj/down 8 rows, gate/up 8 + 8
    streamed to fit one wave of 528 blocks); on gemv.cu Qwen3-4B/8B's QKV takes more rows per warp
    to fit the wave, the rest one row group per block as a GEMV launched alone would (Qwen2.5-0.5B's
    gate/up several per block); x is staged in shared memory except beside attention blocks of more than
    256 query-head values (at 4 rows the launch would exceed 48 KB of shared memory; Qwen2.5's GQA 7
    takes blocks of one head: attention.head_subgroup)."""
    kw, groups = captured_layer(1, shapes, heads, 17)
    epis = (3, 1, 2, 1)
    alone = [G.gemv_blocks(N, e, G.gemv_config(1, K, N, b, e)[1], 4) for (b, _, N, K), e in zip(shapes, epis)]
    assert (groups[0], *groups[2:]) == blocks
    assert max(groups[i] for i in (0, 2, 3, 4)) <= G.RESIDENT_BLOCKS
    assert all(a >= b for a, b in zip(alone, (groups[0], *groups[2:5])))   # the rules only ever remove blocks
    assert (kw["shared_memory"] > 0) == staged


def test_attention_head_subgroups():
    """Query heads per attention block of the one-launch layer: pairs of an even G, one of an odd G
    (all of an odd G took the launch over 128 registers: attention.head_subgroup)."""
    assert [A.head_subgroup(G) for G in range(1, 9)] == [1, 2, 1, 2, 1, 2, 1, 2]


@pytest.mark.parametrize("name,heads,one_row", [(name, heads, n) for (name, _, heads, _, _), n in
                                                zip(LAYERS, (64, 33, 33, 33, 37, 64))])
def test_attention_splits_within_one_wave(name, heads, one_row):
    """Decode attention's splits of the sequence (attention.attn_partials, as layer.layers_launch and
    FastBlock.wide ask for them) at 1-64 rows: at most ATTN_TARGET_BLOCKS blocks (more were slower on
    the H200: docs/cuda-design.md) and the merge's 64 splits, partials sized by them; at one row the
    measured cut (Qwen3-4B/8B: 33 splits of 16 kv head x head subgroup rows, every one of 528 slots)."""
    H, HKV, D = heads
    G = H // HKV
    gb = A.head_subgroup(G)
    for M in range(1, 65):
        nsplit, (pm, po) = A.attn_partials(M * HKV, None, G, gb, D)
        blocks = nsplit * M * HKV * (G // gb)
        assert 1 <= nsplit <= A.ATTN_MAX_SPLITS and (blocks <= A.ATTN_TARGET_BLOCKS or nsplit == 1), (M, nsplit)
        assert pm == (M * HKV, nsplit, G, 2) and po == (M * HKV, nsplit, G, D)
        if M == 1:
            assert nsplit == one_row


@pytest.mark.parametrize("variant,name,batch,L", [
    ("one_wave", "qwen3-tiny", 1, 1), ("one_wave", "llama-tiny", 2, 1), ("stream", "qwen3-tiny", 1, 1),
    ("stream", "qwen3-tiny", 2, 1), ("stream_mma", "llama-tiny", 1, 1), ("stream_mma", "llama-tiny", 2, 3),
    ("stream_mma_2", "llama-tiny", 1, 1)])
def test_layer_blocking_keeps_bits(variant, name, batch, L, monkeypatch):
    """The launch's blocking rules, forced onto a tiny model by a smaller wave, keep the layer's
    outputs and cache rows bit for bit. one_wave (a one-block wave, any K): every GEMV phase takes
    its most rows per warp (QKV 4, so its blocks tile a head in 4 instead of 16). stream (a
    three-block wave): the o_proj, gate/up and down phases run their row groups 3 blocks at a time,
    in uneven shares, against one group per block (gemv.cu: Qwen3-tiny's K = 192 is not gemv_mma.cu's).
    stream_mma: the same over gemv_mma.cu's tiles (gate/up's 56 tiles 3 blocks at a time: each block's
    first, then from the tile queue). stream_mma_2: a 28-block wave, 2 tiles a block in fixed shares
    (no queue)."""
    from mlx_fastops import synthetic_model
    import mlx_fastops

    monkeypatch.setenv("MLX_FASTOPS_BACKEND", "cuda")
    model = synthetic_model(name, bits=4, dtype=mx.bfloat16, seed=3)
    mlx_fastops.patch(model, disable=("compile",))
    try:
        fb = model.model.layers[0].fast_fn
        M, K = batch * L, fb.K
        k0 = mx.random.normal((batch, fb.HKV, 512, fb.D)).astype(mx.bfloat16)
        x = mx.random.normal((batch, L, model.args.hidden_size)).astype(mx.bfloat16)
        base = layer_outputs(fb, x, k0)
        if variant == "one_wave":
            assert G.gemv_config(M, K, fb.qkv.out_features, 4, 3, True)[1] == 2
            monkeypatch.setattr(G, "RESIDENT_BLOCKS", 1)
            monkeypatch.setattr(G, "ONE_WAVE_MIN_K", 0)
            kernels.clear_builders()
            assert G.gemv_config(M, K, fb.qkv.out_features, 4, 3, True)[1] == 4
        else:
            monkeypatch.setattr(G, "RESIDENT_BLOCKS", 28 if variant == "stream_mma_2" else 3)
            kernels.clear_builders()
            N = fb.gate_up.out_features
            on_mma = variant.startswith("stream_mma")
            assert G.mma_takes(mx.bfloat16, M, K, N, 4, 64, 2, False, True) == on_mma
            if on_mma:
                nb = G.mma_tiles(N, 2)
            else:
                nb = G.gemv_blocks(N, 2, G.gemv_config(M, K, N, 4, 2, True)[1], 4)
            if variant == "stream_mma_2":
                assert G.stream_blocks(nb) * 2 == nb   # streamed, 2 tiles a block
            else:
                assert G.stream_blocks(nb) == 3 and nb % 3   # streamed, in uneven shares
        forced = layer_outputs(fb, x, k0)
    finally:
        mlx_fastops.unpatch(model)
        kernels.clear_builders()   # no kernel built with the forced sizes outlives the test
    for a, b in zip(base, forced):
        assert mx.array_equal(a, b)
