"""Whole-model fidelity of patch(): greedy tokens and logits of patched == stock, and the patcher's
contract (unpatch, idempotence, report, errors)."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from decoding import greedy, prompt_of
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache
from mlx_lm.utils import _get_classes

import mlx_fastops
from mlx_fastops import profiler
from mlx_fastops.kernels import data_dir
from mlx_fastops.modules import FusedAttention, FusedBlock, FusedMLP
from mlx_fastops.synthetic import CONFIGS

# Every built-in family (a recipe in patches/), each through its synthetic test model.
FAMILIES = sorted(p.stem for p in data_dir("patches").glob("*.json"))
TINY = [f"{family}-tiny" for family in FAMILIES]

_models = {}


def model_of(name, bits):
    if (name, bits) not in _models:
        _models[name, bits] = mlx_fastops.synthetic_model(name, bits=bits)
    m = _models[name, bits]
    mlx_fastops.unpatch(m)
    return m


CASES = [
    # (model, bits, batch, prompt length, kv_bits, max_kv_size)
    (name, bits, batch, length, None, None)
    for name in TINY
    for bits in (None, 4, 8)
    for batch, length in ((1, 20), (2, 300))
] + [
    ("qwen3-tiny", 4, 1, 40, 8, None),      # QuantizedKVCache
    ("llama-tiny", 8, 2, 30, 4, None),
    ("qwen3-tiny", 4, 1, 100, None, 64),    # RotatingKVCache (max_kv_size)
]


@pytest.mark.parametrize("name,bits,batch,length,kv_bits,max_kv", CASES,
                         ids=[f"{c[0]}-b{c[1]}-B{c[2]}-L{c[3]}-kv{c[4]}-rot{c[5]}" for c in CASES])
def test_greedy_tokens_identical(name, bits, batch, length, kv_bits, max_kv):
    model = model_of(name, bits)
    prompt = prompt_of(model, batch, length)
    stock, stock_logits = greedy(model, prompt, 32, kv_bits, max_kv)
    report = mlx_fastops.patch(model)
    assert report.fused and not report.skipped
    assert report.family == name.removesuffix("-tiny")
    fused, fused_logits = greedy(model, prompt, 32, kv_bits, max_kv)
    assert fused == stock
    # The reference path computes the same math in the same order.
    assert mx.allclose(fused_logits, stock_logits, rtol=1e-5, atol=1e-4)
    if max_kv:
        assert isinstance(make_prompt_cache(model, max_kv_size=max_kv)[0], RotatingKVCache)
    mlx_fastops.unpatch(model)


def test_synthetic_logits_are_peaked_and_tokens_vary():
    for name in TINY:
        model = model_of(name, 4)
        tokens, _ = greedy(model, prompt_of(model, 1, 16, seed=3), 32)
        assert len(set(tokens[0])) >= 8, f"{name}: greedy tokens barely vary: {tokens[0]}"
        logits = model(prompt_of(model, 1, 64, seed=4))[0]
        top2 = mx.sort(logits, axis=-1)[:, -2:]
        margins = sorted((top2[:, 1] - top2[:, 0]).tolist())
        assert margins[len(margins) // 2] > 0.5, f"{name}: median top-1/top-2 margin {margins[len(margins) // 2]}"


@pytest.mark.parametrize("name", TINY)
def test_patched_ops_actually_run(name):
    model = model_of(name, 4)
    mlx_fastops.patch(model)
    # model.model.layers is the list the forward pass iterates (qwen2's Model.layers is a fresh slice)
    assert all(type(layer) is FusedBlock for layer in model.model.layers)
    assert type(model.layers[0].self_attn) is FusedAttention and type(model.layers[0].mlp) is FusedMLP
    prof = profiler.Profile()
    prof.recording = True
    with profiler.instrument(model, prof):
        mx.eval(model(mx.array([[1, 2, 3]])))
    n = len(model.layers)
    for op in ("qkv_proj", "gate_up_silu", "qk_norm_rope", "rms_norm_residual", "flash_attention"):
        assert len(prof.times[op]) == n, (op, dict(prof.times))
    assert len(prof.times["lm_head"]) == 1
    # Stock separate projections no longer run.
    assert "q_proj" not in prof.times and "gate_proj" not in prof.times
    mlx_fastops.unpatch(model)


def test_unpatch_restores_modules_and_outputs_exactly():
    model = model_of("llama-tiny", 4)
    x = prompt_of(model, 1, 9)
    before = model(x)
    layers = list(model.layers)
    head_cls = type(model.lm_head)
    keys = sorted(k for k, _ in __import__("mlx.utils").utils.tree_flatten(model.parameters()))
    mlx_fastops.patch(model)
    assert sorted(k for k, _ in __import__("mlx.utils").utils.tree_flatten(model.parameters())) == keys
    assert mlx_fastops.unpatch(model) is True
    assert all(a is b for a, b in zip(model.layers, layers)) and type(model.lm_head) is head_cls
    assert mx.array_equal(model(x), before)
    assert mlx_fastops.unpatch(model) is False


def test_patch_twice_is_a_noop():
    model = model_of("qwen2-tiny", 8)
    r1 = mlx_fastops.patch(model)
    layers = list(model.layers)
    r2 = mlx_fastops.patch(model)
    assert r1 is r2 and all(a is b for a, b in zip(model.layers, layers))
    mlx_fastops.unpatch(model)


def test_report_lists_disabled_and_unsupported(monkeypatch):
    monkeypatch.setenv("MLX_FASTOPS_DISABLE", "gate_up")
    model = mlx_fastops.synthetic_model("qwen3-tiny", bits=3)
    report = mlx_fastops.patch(model, disable=["residual_norm"])
    skipped = {(e.fusion, e.reason) for e in report.skipped}
    assert ("gate_up", "disabled") in skipped and ("residual_norm", "disabled") in skipped
    assert any(f == "qkv" and "bits=3" in r for f, r in skipped)
    assert any(f == "lm_head" and "bits=3" in r for f, r in skipped)
    text = str(report)
    assert "| qkv | skipped |" in text and "disabled" in text
    assert report.to_dict()["family"] == "qwen3"


def test_mistral_loads_as_llama_and_is_patched():
    cfg = dict(CONFIGS["llama-tiny"], model_type="mistral")
    cfg.pop("rope_scaling")
    Model, Args = _get_classes(cfg)
    model = Model(Args.from_dict(cfg))
    assert mlx_fastops.patch(model).family == "llama"


def test_unsupported_family_names_supported_ones():
    cfg = {"model_type": "phi3", "hidden_size": 64, "num_hidden_layers": 1, "intermediate_size": 128,
           "num_attention_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": 100, "num_key_value_heads": 2,
           "max_position_embeddings": 128, "rope_theta": 10000.0}
    Model, Args = _get_classes(cfg)
    with pytest.raises(ValueError, match="unsupported model family.*" + ".*".join(FAMILIES)):
        mlx_fastops.patch(Model(Args.from_dict(cfg)))


@pytest.mark.parametrize("obj", [nn.Linear(4, 4), "model", None])
def test_not_an_mlx_lm_model(obj):
    with pytest.raises(TypeError, match="expects an mlx-lm model"):
        mlx_fastops.patch(obj)


def test_bad_env_names(monkeypatch):
    model = model_of("qwen3-tiny", 4)
    monkeypatch.setenv("MLX_FASTOPS_DISABLE", "qkv,fast_everything")
    with pytest.raises(ValueError, match="fast_everything.*valid names"):
        mlx_fastops.patch(model)
    monkeypatch.setenv("MLX_FASTOPS_DISABLE", "")
    monkeypatch.setenv("MLX_FASTOPS_BACKEND", "tpu")
    with pytest.raises(ValueError, match="MLX_FASTOPS_BACKEND"):
        mlx_fastops.patch(model)
    assert not mlx_fastops.is_patched(model)


@pytest.mark.skipif(mx.cuda.is_available(), reason="needs a machine without CUDA")
def test_forced_gpu_backend_without_the_device_is_refused(monkeypatch):
    monkeypatch.setenv("MLX_FASTOPS_BACKEND", "cuda")
    model = mlx_fastops.synthetic_model("qwen3-tiny", bits=4)
    with pytest.raises(ValueError, match="no cuda device"):
        mlx_fastops.patch(model)
    assert not mlx_fastops.is_patched(model)


def test_reference_backend_switch(monkeypatch):
    monkeypatch.setenv("MLX_FASTOPS_BACKEND", "reference")
    model = model_of("qwen3-tiny", 4)
    report = mlx_fastops.patch(model)
    assert report.backend == "reference" and {e.backend for e in report.fused} == {"reference"}
    mlx_fastops.unpatch(model)


@pytest.mark.metal
def test_quantized_kv_cache_with_metal_kernels(monkeypatch):
    """kv_bits=8: prompt and decode attention over mlx-lm's QuantizedKVCache through the int8 KV
    flash-attention kernel (emulator on Linux), greedy tokens equal stock."""
    import metal_emu

    monkeypatch.setattr(metal_emu.config, "schedules", "min")
    monkeypatch.setenv("MLX_FASTOPS_BACKEND", "metal")
    monkeypatch.delenv("MLX_FASTOPS_DISABLE", raising=False)
    model = mlx_fastops.synthetic_model("qwen3-tiny", bits=None, dtype=mx.float16)
    prompt = prompt_of(model, 1, 12)
    stock, _ = greedy(model, prompt, 3, kv_bits=8)
    mlx_fastops.patch(model)
    prof = profiler.Profile()
    prof.recording = True
    with profiler.instrument(model, prof):
        fused, _ = greedy(model, prompt, 3, kv_bits=8)
    mlx_fastops.unpatch(model)
    assert fused == stock
    assert len(prof.times["quantized_attention"]) == 3 * len(model.layers)


def test_fp32_oracle_measures_half_precision_error():
    from mlx_fastops import fidelity

    oracle_model = fidelity.fp32_oracle(mlx_fastops.synthetic_model("llama-tiny", bits=4, dtype=mx.bfloat16))
    assert type(oracle_model.layers[0].self_attn.q_proj) is nn.Linear
    assert oracle_model.layers[0].self_attn.q_proj.weight.dtype == mx.float32
    model = mlx_fastops.synthetic_model("llama-tiny", bits=4, dtype=mx.bfloat16)
    prompt, tokens = mx.array([3, 1, 4, 1, 5]), [9, 2, 6, 5, 3]
    oracle = fidelity.forced_logits(oracle_model, prompt, tokens)
    stock = fidelity.against(fidelity.forced_logits(model, prompt, tokens), oracle)
    mlx_fastops.patch(model)
    fused = fidelity.against(fidelity.forced_logits(model, prompt, tokens), oracle)
    mlx_fastops.unpatch(model)
    assert stock["mean_abs"] > 1e-3  # bf16 is measurably off the float32 model
    assert fused == stock  # the reference path computes exactly what stock computes
    model.set_dtype(mx.float32)  # the same quantised model with float32 activations and scales
    assert fidelity.against(fidelity.forced_logits(model, prompt, tokens), oracle)["top1_agree"] == 1.0


def _batched_greedy(model, prompt, left_padding, n):
    """Greedy decode with mlx-lm's BatchKVCache (per-sequence offsets, array masks: what
    batch_generate and the server use)."""
    from mlx_lm.models.cache import BatchKVCache

    cache = [BatchKVCache(left_padding=left_padding) for _ in model.layers]
    logits = model(prompt, cache=cache)
    out = []
    for _ in range(n):
        tok = mx.argmax(logits[:, -1, :], axis=-1)
        out.append(tok)
        logits = model(tok[:, None], cache=cache)
    return mx.stack(out, axis=1).tolist()


@pytest.mark.parametrize("path", ["reference", pytest.param("metal", marks=pytest.mark.metal)])
def test_batch_kv_cache_left_padding(path, monkeypatch):
    if path == "metal":
        import metal_emu

        monkeypatch.setattr(metal_emu.config, "schedules", "min")
    monkeypatch.setenv("MLX_FASTOPS_BACKEND", path)
    monkeypatch.delenv("MLX_FASTOPS_DISABLE", raising=False)
    model = mlx_fastops.synthetic_model("qwen3-tiny", bits=4, dtype=mx.float16 if path == "metal" else None)
    prompt = prompt_of(model, 2, 12, seed=5)
    n = 3 if path == "metal" else 24
    stock = _batched_greedy(model, prompt, [0, 5], n)
    mlx_fastops.patch(model)
    try:
        assert _batched_greedy(model, prompt, [0, 5], n) == stock
    finally:
        mlx_fastops.unpatch(model)
