"""Layers per launch: several layers in one launch compute what one launch per layer does, the
decode step launches what step.launch_runs says; and the phase stamps of an instrumented launch
(phases.py, benchmarks/cuda_layer_phases.py). On the GPU with `pytest -m cuda`, elsewhere through
the CPU emulator of tests/cuda_emu."""

import json

import mlx.core as mx
import numpy as np
import pytest

from mlx_fastops import kernels
from mlx_fastops.backends.cuda import attention as A
from mlx_fastops.backends.cuda import gemv as G
from mlx_fastops.backends.cuda import block, layer, step
from mlx_fastops.backends.cuda.phases import STAMP_COLS, sm_load
from mlx_fastops.backends.cuda.source import offset_array

from cuda_checks import ON_GPU, assert_marks_in_order

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("on_gpu")]   # on_gpu: the GPU, else the emulator


@pytest.mark.parametrize("name,batch,L,layers,wave", [("qwen3-tiny", 1, 1, 3, None), ("llama-tiny", 2, 2, 2, None),
                                                      ("qwen2-tiny", 1, 1, 3, None), ("qwen3-tiny", 2, 1, 3, None),
                                                      ("llama-tiny", 1, 1, 3, 3)])
def test_layers_in_one_launch_match_one_per_layer(name, batch, L, layers, wave, monkeypatch, request):
    """Every layer of a short model in one launch (the residual stream between them in scratch
    outputs, one call site per phase) computes exactly what one launch
    per layer computes; so does the launch with phase stamps (layers_launch(stamps=True), which
    benchmarks/cuda_layer_phases.py reads), whose every block is stamped, entry before end, and
    ends after every block of the group before it (its wait; attention blocks whose split is past
    the valid length exit at once), across the layers; every block that waits marks its wait's end
    after the group before it ended, then its first step and its written outputs, in that order
    before its end (one that exits early marks nothing); the benchmark's per-phase tables of them
    are ordered the same way. wave: a wave of that many blocks, so gate/up (gemv_mma.cu) runs its tiles
    a few blocks at a time, from each layer's tile queue (gemv_mma.cu's TILE_QUEUE)."""
    from mlx_fastops import synthetic_model
    import mlx_fastops

    monkeypatch.setenv("MLX_FASTOPS_BACKEND", "cuda")
    if wave:   # (RESIDENT_BLOCKS is not in the kernel cache's key: no kernel built under it outlives the test)
        monkeypatch.setattr(G, "RESIDENT_BLOCKS", wave)
        kernels.clear_builders()
        request.addfinalizer(kernels.clear_builders)
    model = synthetic_model(name, bits=4, dtype=mx.bfloat16, seed=3, layers=layers)
    mlx_fastops.patch(model, disable=("compile",))
    try:
        fbs = [layer.fast_fn for layer in model.model.layers]
        assert len(fbs) == layers and all(fb.launch_key() == fbs[0].launch_key() for fb in fbs)
        if wave:
            N, tiles = fbs[0].gate_up.out_features, G.mma_tiles(fbs[0].gate_up.out_features, 2)
            assert G.mma_takes(mx.bfloat16, batch * L, fbs[0].K, N, 4, 64, 2, False, True)
            assert tiles > 2 * G.stream_blocks(tiles)   # 3 or more tiles a block: queued
        P, D, HKV = 300, fbs[0].D, fbs[0].HKV
        caches = [[mx.random.normal((batch, HKV, 512, D)).astype(mx.bfloat16) for _ in range(2)] for _ in fbs]
        x = mx.random.normal((batch, L, model.args.hidden_size)).astype(mx.bfloat16)
        off = offset_array(P)
        results = []
        for mode in ("per layer", "together", "stamped"):
            bufs = [(kc + 0, vc + 0) for kc, vc in caches]
            mx.eval(bufs)
            if mode == "per layer":
                out = x
                for fb, (kc, vc) in zip(fbs, bufs):
                    out, o = fb.core(out, off, kc, vc, kc)
            else:
                out, o, *stamped = layer.layers_launch(fbs, x, off, [(kc, vc, kc) for kc, vc in bufs],
                                                   stamps=mode == "stamped")
            mx.eval(out, o)
            results.append((out, o, bufs))
        assert not np.asarray(fbs[0].layer_counters(layers)).any(), "counters not reset"
    finally:
        mlx_fastops.unpatch(model)
    (out1, o1, bufs1), *launched = results
    assert np.isfinite(np.asarray(out1.astype(mx.float32))).all()
    for out2, o2, bufs2 in launched:
        assert mx.array_equal(out1, out2) and mx.array_equal(o1, o2)   # o: the last layer's attention
        for (k1, v1), (k2, v2) in zip(bufs1, bufs2):
            assert mx.array_equal(k1, k2) and mx.array_equal(v1, v2)
    st, groups = np.asarray(stamped[0]), stamped[1]
    assert len(groups) == layers * layer.LAYER_GROUPS and st.shape == (sum(groups), STAMP_COLS)
    assert (st != 0x7F7F7F7F7F7F7F7F).all() and (st[:, 0] < st[:, 1]).all(), "a block was not stamped"
    assert ((st[:, 2] >= 0) & (st[:, 2] < 1024)).all(), "an SM id out of range"
    bounds = np.cumsum([0, *groups])
    ends = [st[a:b, 1] for a, b in zip(bounds[:-1], bounds[1:])]
    fb = fbs[0]
    # the attention groups hold the launch's splits for every (row, kv head, head subgroup)
    group = fb.H // fb.HKV
    splits = layer.attention_splits(fb, batch * L)[0]
    assert all(n == splits * fb.HKV * (group // fb.gb) * batch * L for n in groups[1::layer.LAYER_GROUPS])
    for g in range(1, len(ends)):
        waited = np.ones(len(ends[g]), bool)
        if g % layer.LAYER_GROUPS == 1:   # attention: a split past the valid length exits before its wait
            i = np.arange(len(waited))
            n = P + (i // (len(waited) // (batch * L))) % L + 1   # positions of block i's query
            chunk = np.maximum(-(-n // splits), A.ATTN_MINCH)
            waited = i % splits < -(-n // chunk)
        assert ends[g][waited].min() > ends[g - 1].max(), f"group {g} ended before group {g - 1}"
        marks = st[bounds[g]:bounds[g + 1], 3:]
        assert (marks[waited] != 0).all() and (marks[~waited] == 0).all(), f"group {g}: marks of the wrong blocks"
        assert marks[waited, 0].min() > ends[g - 1].max(), f"group {g}: a wait's mark before group {g - 1} ended"
    assert (st[:groups[0], 3:] != 0).all(), "a block of the first group did not mark"
    assert_marks_in_order(st)
    from mlx_fastops.backends.cuda.phases import mark_rows, phase_rows, set_tails
    rows = phase_rows(st, groups)
    # blocks of several groups enter within one tick of the first: the earliest is any group's
    assert len(rows) == len(groups) and min(r[0] for r in rows) == 0.0
    for (first, ready, p90, end), prev in zip(rows, [(0, 0, 0, 0.0)] + rows):
        assert ready == prev[3] and first <= p90 <= end and end > ready
    for (_, ready, _, end), med, high in zip(rows, mark_rows(st, groups), mark_rows(st, groups, 90)):
        assert list(med) == sorted(med) and all(a <= b for a, b in zip(med, high))
        assert ready <= med[0] and high[-1] <= end
    # the benchmark's ticketed sets (a row's splits; a head's QKV blocks): a tail each, none elsewhere
    tails = set_tails(st, groups, layer.ticketed_sets(fb, groups, batch * L))
    assert [t is not None for t in tails] == [g % layer.LAYER_GROUPS < 2 for g in range(len(groups))]


@pytest.mark.parametrize("late_entry,late,per_sm", [(16, [0, 1], 2), (11, [0, 0], 3)])
def test_phase_stamps_second_wave_and_residency(late_entry, late, per_sm):
    """phases.late_blocks counts a group's blocks that entered after one of its own had ended;
    residency gives the most blocks alive at once (in the launch, on one SM) and the SMs."""
    from mlx_fastops.backends.cuda.phases import late_blocks, residency
    st = np.array([(0, 10, 0), (0, 12, 1),                         # group 0
                   (1, 20, 0), (1, 15, 1), (late_entry, 25, 1)])   # group 1: its block 1 ends at 15
    assert late_blocks(st, [2, 3]) == late
    assert residency(st) == (4, per_sm, 2)


def test_phase_tables_over_a_float_and_a_quantized_cache(monkeypatch):
    """benchmarks/cuda_layer_phases.py (measure, markdown) on a tiny model over the float cache and an
    8-bit one (--kv-bits): a table of each, every phase's median marks in order from its ready time to
    its end, the quantised cache's attention reading fewer bytes, its table and summary row labelled."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "cuda_layer_phases.py"
    spec = importlib.util.spec_from_file_location("cuda_layer_phases", path)
    lp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lp)
    monkeypatch.setenv("MLX_FASTOPS_BACKEND", "cuda")   # (measure sets it: restored after the test)
    runs = [r for kv in (0, 8) for r in lp.measure("qwen3-tiny-qmm", [1], 100, 1, [A.ATTN_TARGET_BLOCKS], ["compile"],
                                                    flush_mb=0, kv_bits=kv, keep_stamps=kv == 0)]
    assert "stamps_median_rep" in runs[0] and "stamps_median_rep" not in runs[1]   # only where asked
    assert [r["kv_bits"] for r in runs] == [0, 8]
    for r in runs:
        assert [p["phase"] for p in r["phases"]] == list(lp.PHASES)
        for p in r["phases"]:
            marks = p["marks_median_us"]
            assert p["ready_us"] <= marks[0] and list(marks) == sorted(marks) and marks[-1] <= p["end_us"], p
        for p in r["phases"]:   # no more SMs than the launch ran on (the emulator runs every block on "SM 0")
            assert sum(v[0] for v in p["per_sm"].values()) <= r["sms"], p
            assert ON_GPU or list(p["per_sm"]) == [str(p["blocks"])], p
        if "stamps_median_rep" not in r:
            continue
        st = np.array(json.loads(json.dumps(r["stamps_median_rep"])))   # the JSON's raw stamps: every block
        assert st.shape == (sum(r["groups"]), STAMP_COLS) and st[:, 0].min() == 0 and (st[:, 1] > st[:, 0]).all()
        for p, load in zip(r["phases"], sm_load(st, r["groups"])):   # the per-SM table reads those stamps
            assert p["per_sm"] == {str(k): v for k, v in load.items()}, p
    from types import SimpleNamespace
    w = SimpleNamespace(weight=np.zeros(1), scales=np.zeros(1), biases=np.zeros(1))
    fb = SimpleNamespace(HKV=2, D=64, qkv=w, o=w, gate_up=w, down=w)   # qwen3-tiny-qmm's heads
    float_attn, kv8_attn = (lp.phase_bytes(fb, 1, 101, kv)[1] for kv in (0, 8))   # K and V of 101 positions
    assert float_attn == 2 * 2 * 101 * 128 and kv8_attn == 2 * 2 * 101 * (64 + 4)   # + a bf16 scale and bias
    got = [r["phases"][1]["GBs"] * r["phases"][1]["time_us"] * 1e3 for r in runs]   # the tables' bytes
    assert got == pytest.approx([float_attn, kv8_attn])
    md = lp.markdown(runs, {"device": "-", "mlx": "-", "commit": "-", "source": "-", "copy_GBs": 1.0})
    assert md.count("Inside the phases") == 2 and md.count("Blocks of a phase per SM") == 2
    assert "cached positions, kv_bits 8," in md and "| qwen3-tiny-qmm (kv_bits 8) |" in md


def test_relative_stamps_keep_unreached_marks():
    """phases.relative_stamps: times from the first entry, a mark of 0 (not reached) still 0, SMs kept."""
    from mlx_fastops.backends.cuda.phases import relative_stamps
    st = [(5000, 9000, 7, 6000, 7000, 8000), (4000, 4500, 3, 0, 0, 0)]   # the second block exited early
    assert relative_stamps(st) == [[1000, 5000, 7, 2000, 3000, 4000], [0, 500, 3, 0, 0, 0]]


def test_sm_load_groups_blocks_by_their_sms_count():
    """phases.sm_load: per group, SMs by how many of its blocks they ran, and those blocks' median end."""
    from mlx_fastops.backends.cuda.phases import sm_load
    st = [(0, 1000, 0), (0, 2000, 0), (0, 3000, 0), (0, 500, 1),   # group 0: SM 0 ran 3, SM 1 ran 1
          (0, 4000, 0), (0, 6000, 1)]                              # group 1: one each
    assert sm_load(st, [4, 2]) == [{1: (1, 0.5), 3: (1, 2.0)}, {1: (2, 5.0)}]


@pytest.mark.parametrize("sets,tails", [([2, 3], [(0.85, 1.5), (0.5, 0.5)]),   # group 0's sets end 1.2, 1.0 / 3.0, 1.5
                                        ([4, 0], [(1.5, 1.5), None]),
                                        ([3, 3], ValueError)])                  # 4 blocks are no sets of 3
def test_phase_set_tails(sets, tails):
    """phases.set_tails: per ticketed set of consecutive blocks, its last end minus its second-last
    (whatever their order in the set); the median over the group's sets and the value of the set
    that ended last; sets that do not tile a group are refused."""
    from mlx_fastops.backends.cuda.phases import set_tails
    st = np.array([(0, 1200, 0), (0, 1000, 0), (0, 3000, 0), (0, 1500, 0),   # group 0
                   (0, 3800, 0), (0, 3100, 0), (0, 3300, 0)])                # group 1
    if tails is ValueError:
        with pytest.raises(ValueError, match="do not tile"):
            set_tails(st, [4, 3], sets)
        return
    got = set_tails(st, [4, 3], sets)
    assert [g if g is None else tuple(round(v, 9) for v in g) for g in got] == tails


def test_decode_step_with_layers_sharing_launches(monkeypatch):
    """The decode step (run eagerly: the emulator cannot be traced by mx.compile) with both layers
    in one launch (the default for small layers) gives the same logits as with one launch per layer
    (layers above GROUP_MAX_WEIGHTS) and as large layers sharing a launch at one row
    (LARGE_SHARED_MAX_ROWS); the step launches what launch_runs says for its row count (a 6-token
    prompt, then one-row steps), and the report's compile row says so."""
    from mlx_fastops import fidelity, synthetic_model
    import mlx_fastops

    monkeypatch.setenv("MLX_FASTOPS_BACKEND", "cuda")
    launched = set()   # (rows of the step, layers in the launch)

    def launch(blocks, x, *args, _launch=step.layers_launch):
        launched.add((x.shape[0] * x.shape[1], len(blocks)))
        return _launch(blocks, x, *args)

    monkeypatch.setattr(step, "layers_launch", launch)
    prompt = mx.random.randint(0, 4096, (6,), key=mx.random.key(5))
    logits = []
    mx.disable_compile()
    try:
        wide = "; decode steps of over 8 rows: the composed ops (a weight qmm does not take)"   # hidden size 192
        for limit, shared_rows, launches, note in (
                (block.GROUP_MAX_WEIGHTS, 0, {(6, 2), (1, 2)}, "2 layers in 1 launch" + wide),
                (0, 0, {(6, 1), (1, 1)}, "2 layers in 2 launches" + wide),
                (0, 1, {(6, 1), (1, 2)}, "2 layers in 1 launch at 1 row, 2 launches at 2-8 rows" + wide)):
            monkeypatch.setattr(block, "GROUP_MAX_WEIGHTS", limit)
            monkeypatch.setattr(step, "LARGE_SHARED_MAX_ROWS", shared_rows)
            model = synthetic_model("qwen3-tiny", bits=4, dtype=mx.bfloat16, seed=4)
            report = mlx_fastops.patch(model)
            assert [(e.status, e.reason) for e in report.entries if e.fusion == "compile"] == [("fused", note)]
            launched.clear()
            logits.append(fidelity.forced_logits(model, prompt, [7, 99, 1234]))
            assert launched == launches
            mlx_fastops.unpatch(model)
    finally:
        mx.enable_compile()
    assert np.isfinite(np.asarray(logits[0])).all()
    assert all(mx.array_equal(logits[0], other) for other in logits[1:])


def test_launch_runs(monkeypatch):
    """Consecutive groupable layers of one launch key share a launch at any row count; a layer that
    is not groupable, or of another key, starts a new launch; large layers of one key share one in
    steps of up to LARGE_SHARED_MAX_ROWS rows; no launch takes over MAX_LAYERS_PER_LAUNCH."""
    from types import SimpleNamespace
    keys = [1, 1, 1, 1, 1, 1, 1, 2, 2, 2]
    fasts = [SimpleNamespace(grouped=i not in (0, 9), launch_key=lambda k=k: k) for i, k in enumerate(keys)]
    large = [SimpleNamespace(grouped=False, launch_key=lambda k=k: k) for k in keys]
    mixed = [(0, 1), (1, 6), (7, 2), (9, 1)]
    apart = [(i, 1) for i in range(10)]
    for shared_rows, rows, runs, large_runs in ((1, 1, mixed, [(0, 7), (7, 3)]), (1, 2, mixed, apart),
                                                (0, 1, mixed, apart), (4, 4, mixed, [(0, 7), (7, 3)]),
                                                (4, 8, mixed, apart)):
        monkeypatch.setattr(step, "LARGE_SHARED_MAX_ROWS", shared_rows)
        assert step.launch_runs(fasts, rows) == runs
        assert step.launch_runs(large, rows) == large_runs
    monkeypatch.setattr(step, "MAX_LAYERS_PER_LAUNCH", 4)   # NVRTC's bound on kernel parameters
    assert step.launch_runs(fasts, 1) == [(0, 1), (1, 4), (5, 2), (7, 2), (9, 1)]
    assert step.launch_runs(large, 1) == [(0, 4), (4, 3), (7, 3)]


@pytest.mark.parametrize("limit,grouped", [(1.0, True), (0.99, False)])
def test_layers_grouped_by_layer_size(limit, grouped, monkeypatch):
    """Layers of up to GROUP_MAX_WEIGHTS may share a launch (where the H200 measured it faster;
    the limit is set here relative to the tiny layer's size)."""
    from mlx_fastops import synthetic_model
    import mlx_fastops

    monkeypatch.setenv("MLX_FASTOPS_BACKEND", "cuda")
    model = synthetic_model("qwen3-tiny", bits=4, dtype=mx.bfloat16)
    c = model.args
    D = c.head_dim
    weights = c.hidden_size * (D * (c.num_attention_heads + 2 * c.num_key_value_heads) + 3 * c.intermediate_size) \
        + D * c.num_attention_heads * c.hidden_size
    monkeypatch.setattr(block, "GROUP_MAX_WEIGHTS", int(limit * weights))
    report = mlx_fastops.patch(model, disable=("compile",))   # the emulator cannot be traced
    try:
        fb = model.model.layers[0].fast_fn
        assert fb.weights == weights and fb.grouped is grouped
        entries = [e for e in report.entries if e.fusion == "fast_decode"]
        assert len(entries) == c.num_hidden_layers and all(e.status == "fused" for e in entries)
    finally:
        mlx_fastops.unpatch(model)
