"""What the op table (tests/test_ops.py) cannot check of the Metal GEMV family (metal/gemv.metal):
which shape classes the wrappers take, the segmented qkv grid, run-time fallbacks, and the strict
compile tier over every instantiation the wrappers can launch.
"""

import math
import os

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_fastops import ops
from mlx_fastops.backends import reference
from mlx_fastops.backends.metal import gemv as G
from mlx_fastops.ops.weights import PackedLinear

metal = pytest.mark.metal  # kernel-running tests: emulator on Linux, GPU on a Mac (metal_fixtures)


def packed(splits, k, dtype, bits=4, group=64):
    mx.random.seed(0)
    mods = []
    for n in splits:
        lin = nn.Linear(k, n, bias=False)
        lin.set_dtype(dtype)
        mods.append(nn.QuantizedLinear.from_linear(lin, group, bits))
    mx.eval([m.parameters() for m in mods])
    return PackedLinear.stack(mods)


@metal
def test_dtype_mismatch_falls_back():
    w = packed((40,), 256, mx.bfloat16)
    x = mx.random.normal((1, 1, 256)).astype(mx.float16)
    assert mx.array_equal(G.lm_head(x, w), reference.lm_head(x, w))


def _info(**kw):
    base = dict(in_features=1024, splits=(1024, 512, 512), bits=4, group_size=64, dtype=mx.bfloat16,
                bias=False)
    base.update(kw)
    return base


@pytest.mark.parametrize("kw, reason", [
    (dict(bits=None), "float weights"),
    (dict(bits=3), "bits=3"),
    (dict(bits=2, group_size=64), "bits=2"),
    (dict(group_size=16), "group_size=16"),
    (dict(dtype=mx.float32), "dtype"),
    (dict(splits=(4, 1, 1), in_features=64), "too small"),
])
def test_unsupported_shape_classes(kw, reason):
    for fn in (G.unsupported_qkv_proj, G.unsupported_lm_head):
        assert reason in fn(**_info(**kw))
    gate_up = dict(kw, splits=(2, 2) if "splits" in kw else (2048, 2048))
    assert reason in G.unsupported_gate_up_silu(**_info(**gate_up))


def test_supported_shape_classes_select_the_kernels():
    assert G.unsupported_qkv_proj(**_info()) is None
    assert G.unsupported_gate_up_silu(**_info(splits=(3072, 3072))) is None
    assert G.unsupported_lm_head(**_info(splits=(151936,))) is None
    assert "2 equal" in G.unsupported_gate_up_silu(**_info(splits=(3072, 1024)))
    fn, used, reason = ops.select("qkv_proj", "metal", **_info())
    assert (fn, used, reason) == (G.qkv_proj, "metal", None)
    fn, used, reason = ops.select("lm_head", "metal", **_info(bits=5))
    assert used == "reference" and "bits=5" in reason


@metal
def test_qkv_grid_is_segmented(monkeypatch):
    """Each segment gets exactly its own tiles: the small K/V slices do not idle."""
    calls = []
    real = G._launch

    def spy(kind, x2, w, params, tiles, out_shapes):
        calls.append((kind, tiles, [int(p) for p in np.array(params)]))
        return real(kind, x2, w, params, tiles, out_shapes)

    monkeypatch.setattr(G, "_launch", spy)
    w = packed((128 + 8, 40, 40), 256, mx.float16)
    G.qkv_proj(mx.random.normal((1, 1, 256)).astype(mx.float16), w)
    (kind, tiles, p), = calls
    assert kind == "qkv" and tiles == math.ceil(136 / 8) + 2 * math.ceil(40 / 8)
    assert p[4:9] == [136, 40, 40, 17, 22]


# ---------------------------------------------------------------------------------------------
# strict compile tier: every instantiation the wrappers can launch


def _strict_inputs(dtype, bits, mr):
    k, n = 256, 64
    return [mx.zeros((mr, k), dtype), mx.zeros((n, k * bits // 32), mx.uint32), mx.zeros((n, k // 64), dtype),
            mx.zeros((n, k // 64), dtype), mx.zeros((8,), dtype), mx.zeros((9,), mx.int32)]


def _strict_spec(inst):
    kind, dtype, bits, mr = inst
    header, bodies = G.sections()
    spec = dict(name=f"fastops_{kind}", input_names=G.INPUTS, output_names=G._OUTPUTS[kind],
                source=bodies[kind], header=header)
    call = dict(inputs=_strict_inputs(dtype, bits, mr), output_dtypes=[dtype] * len(G._OUTPUTS[kind]),
                template=[("T", dtype), ("BITS", bits), ("MR", mr)], grid=(64, 1, 1), threadgroup=(64, 1, 1))
    return spec, call


@pytest.fixture(scope="module")
def strict_warm():
    """Compile every instantiation once, on all cores (g++ runs in subprocesses), before the
    per-instantiation tests; they then hit metal_emu's strict cache. A failure here is ignored: the
    test of that instantiation compiles it again and reports the error."""
    emu = pytest.importorskip("metal_emu")
    from concurrent.futures import ThreadPoolExecutor

    from metal_emu.source import mlx_source
    from metal_emu.strict import check_strict

    jobs = []
    for inst in G.instantiations():
        spec, call = _strict_spec(inst)
        spec = dict(spec, ensure_row_contiguous=True, atomic_outputs=False, compile_options=None)
        _, src, _ = mlx_source(spec, call["inputs"], [(1,)] * len(spec["output_names"]), call["output_dtypes"],
                               call["grid"], call["threadgroup"], call["template"], None)
        jobs.append((src, spec["header"], spec["source"], spec["name"]))

    def one(job):
        try:
            check_strict(*job)
        except Exception:  # reported by the test of this instantiation
            pass

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=min(8, max(1, cores))) as pool:
        list(pool.map(one, jobs))
    return emu


@pytest.mark.parametrize("inst", G.instantiations(), ids=lambda t: "-".join(str(v).split(".")[-1] for v in t))
def test_strict_compile(strict_warm, inst):
    spec, call = _strict_spec(inst)
    strict_warm.compile_strict(**spec, **call)
