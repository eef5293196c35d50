"""The per-op profile of prefill chunks (mlx_fastops.profiler.profile_prefill): the ops of a chunk,
stock and patched, on the reference path and on the CUDA backend's prefill path; the cached tokens
before a chunk, prefilled in chunks; the per-op medians over the recorded units."""

import pytest
from mlx_lm.models import cache as cache_mod

import mlx_fastops
from mlx_fastops import profiler

# ops of one prefill chunk -> calls per chunk, per layer ("layer": 1 a layer) or per model; no
# lm_head: mlx-lm never evaluates a prefill chunk's logits
_PATCHED = {"qkv_proj": 1, "qk_norm_rope": 1, "kv_cache_update": 1, "flash_attention": 1, "o_proj": 1,
            "rms_norm_residual": 1, "gate_up_silu": 1, "down_proj": 1, "input_layernorm": 1}
OPS = {
    ("qwen3-tiny", "stock"): {"q_proj": 1, "k_proj": 1, "v_proj": 1, "q_norm": 1, "k_norm": 1, "rope": 2,
                              "kv_cache_update": 1, "sdpa": 1, "o_proj": 1, "post_attention_layernorm": 1,
                              "gate_proj": 1, "up_proj": 1, "swiglu": 1, "down_proj": 1, "input_layernorm": 1},
    ("qwen3-tiny", "patched"): _PATCHED,
    ("llama-tiny", "stock"): {"q_proj": 1, "k_proj": 1, "v_proj": 1, "rope": 2, "kv_cache_update": 1, "sdpa": 1,
                              "o_proj": 1, "post_attention_layernorm": 1, "gate_proj": 1, "up_proj": 1,
                              "swiglu": 1, "down_proj": 1, "input_layernorm": 1},
    ("llama-tiny", "patched"): _PATCHED,
}
PER_MODEL = {"embed_tokens": 1, "norm": 1}


def calls_of(result):
    return {r["op"]: r["calls"] for r in result["rows"]}


def expected_calls(per_layer, layers):
    return {**{op: n * layers for op, n in per_layer.items()}, **PER_MODEL}


def check_timings(result):
    assert all(r["ms"] > 0 for r in result["rows"]), result["rows"]
    assert result["ops_ms"] == pytest.approx(sum(r["ms"] for r in result["rows"]))
    assert sum(r["share"] for r in result["rows"]) == pytest.approx(1.0)
    assert [r["ms"] for r in result["rows"]] == sorted((r["ms"] for r in result["rows"]), reverse=True)
    assert result["unit_ms"] > 0 and 0 < result["host_build_ms"] <= result["unit_ms"]


@pytest.mark.parametrize("name,variant", list(OPS))
def test_prefill_profile_times_every_op_of_a_chunk(name, variant):
    model = mlx_fastops.synthetic_model(name)
    if variant == "patched":
        mlx_fastops.patch(model)
    result = profiler.profile_prefill(model, 24, recorded=3, warmup=1)
    assert calls_of(result) == expected_calls(OPS[name, variant], len(model.layers))
    check_timings(result)
    assert (result["unit"], result["chunk"], result["context"], result["recorded"]) == ("chunk", 24, 0, 3)
    assert len(result["events"]) == 3 * sum(calls_of(result).values())   # the recorded chunks only


# (chunk, cached tokens before it) -> the cache offsets its layers write at, per unit: the cached tokens
# prefilled in chunks of the chunk's size first, as mlx-lm's generate_step does
CONTEXTS = [(40, 0, [0]), (40, 50, [0, 40, 50]), (25, 50, [0, 25, 50]), (16, 5, [0, 5])]


@pytest.mark.parametrize("chunk,context,offsets", CONTEXTS)
def test_cached_tokens_before_a_chunk_are_prefilled_in_chunks(chunk, context, offsets, monkeypatch):
    """One chunk recorded after none warm-up: two units (unsynchronised, then op by op), each into
    a fresh cache."""
    model = mlx_fastops.synthetic_model("qwen3-tiny")
    seen, write = [], cache_mod.KVCache.update_and_fetch
    monkeypatch.setattr(cache_mod.KVCache, "update_and_fetch",
                        lambda self, k, v: seen.append(self.offset) or write(self, k, v))
    result = profiler.profile_prefill(model, chunk, context=context, recorded=1, warmup=0)
    layers = len(model.layers)
    assert seen == [o for o in offsets for _ in range(layers)] * 2
    assert calls_of(result)["kv_cache_update"] == layers   # the timed chunk's writes only


@pytest.mark.cuda
def test_prefill_profile_on_the_cuda_prefill_path(monkeypatch):
    """On the CUDA backend (its kernels in the CPU emulator without a GPU) a chunk of the prefill
    path's size: every profiled chunk's projections dense and paced (4 calls a layer), o_proj and
    down_proj under their names, the StaticKVCache write timed, the fast decode path's declined
    calls not counted as an op."""
    from conftest import cuda_factory

    import mlx.core as mx

    from mlx_fastops import kernels
    from mlx_fastops.backends.cuda import prefill

    monkeypatch.setenv("MLX_FASTOPS_BACKEND", "cuda")
    calls, dense_linear = [], prefill.linear
    monkeypatch.setattr(prefill, "linear", lambda x, w: calls.append(x.shape[:-1]) or dense_linear(x, w))
    model = mlx_fastops.synthetic_model("qwen3-tiny", dtype=mx.bfloat16)   # the fast decode path takes half precision only
    with kernels.use_cuda_factory(cuda_factory()[0]):
        # the emulator cannot run inside mx.compile; prefill chunks never take the compiled step
        report = mlx_fastops.patch(model, disable=("compile",))
        try:
            assert {e.fusion for e in report.fused} >= {"prefill", "fast_decode"}
            calls.clear()
            result = profiler.profile_prefill(model, prefill.PREFILL_MIN_ROWS, recorded=1, warmup=0)
        finally:
            mlx_fastops.unpatch(model)
    layers = len(model.layers)
    assert calls == [(1, prefill.PREFILL_MIN_ROWS)] * (2 * 4 * layers)   # two units: unsynchronised, op by op
    assert calls_of(result) == expected_calls(_PATCHED, layers)
    check_timings(result)


# per recorded unit: (op, seconds) per call -> per op (calls per unit, median ms per unit)
UNITS = [
    ([[("a", 1e-3), ("b", 2e-3)], [("a", 3e-3), ("a", 1e-3)], [("a", 2e-3), ("b", 4e-3)]],
     {"a": (4 / 3, 2.0), "b": (2 / 3, 2.0)}),   # b absent from a unit: 0 there
    ([[("x", 5e-3), ("y", 1e-3), ("x", 1e-3)]], {"x": (2, 6.0), "y": (1, 1.0)}),
]


@pytest.mark.parametrize("units,want", UNITS)
def test_rows_are_medians_over_the_recorded_units(units, want):
    table = profiler._rows([[(op, 0.0, s) for op, s in unit] for unit in units])
    assert {r["op"]: r["calls"] for r in table["rows"]} == pytest.approx({op: c for op, (c, _) in want.items()})
    assert {r["op"]: r["ms"] for r in table["rows"]} == pytest.approx({op: ms for op, (_, ms) in want.items()})
    total = sum(ms for _, ms in want.values())
    assert table["ops_ms"] == pytest.approx(total)
    assert {r["op"]: r["share"] for r in table["rows"]} == pytest.approx({op: ms / total for op, (_, ms) in want.items()})
