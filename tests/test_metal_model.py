"""Whole-model greedy agreement with every Metal kernel on (MLX_FASTOPS_BACKEND=metal).

A tiny Qwen3 (head_dim 64, GQA 2, 2 layers) is patched on the Metal backend and decoded greedily
for a few tokens (a 140-token prompt takes decode attention past one chunk: split-K + reduce): the prompt goes through qk_norm_rope + flash attention + rms_norm_residual (and the
GEMV kernels of the quantised model), each new token through the decode-attention kernel reading the
KV cache in place. Tokens must equal stock mlx-lm's. On Linux every kernel runs in the CPU emulator
(emulator-verified); on a Mac on the GPU.
"""

import mlx.core as mx
import pytest
from decoding import greedy

import mlx_fastops

pytestmark = pytest.mark.metal


@pytest.mark.parametrize("bits,dtype,length", [
    pytest.param(None, mx.float32, 9, id="f32"),
    pytest.param(4, mx.float16, 9, id="q4-f16"),
    pytest.param(None, mx.bfloat16, 9, id="bf16"),
    pytest.param(4, mx.float16, 140, id="q4-f16-split-decode", marks=pytest.mark.slow),
])
def test_qwen3_tiny_greedy_with_metal_kernels(monkeypatch, metal_backend, bits, dtype, length):
    if metal_backend == "emulator":
        import metal_emu

        monkeypatch.setattr(metal_emu.config, "schedules", "min")  # order checks: the kernel tests
    monkeypatch.setenv("MLX_FASTOPS_BACKEND", "metal")
    monkeypatch.delenv("MLX_FASTOPS_DISABLE", raising=False)
    model = mlx_fastops.synthetic_model("qwen3-tiny", bits=bits, dtype=dtype)
    prompt = mx.random.randint(0, model.args.vocab_size, (1, length), key=mx.random.key(3))
    n = 4
    stock, stock_logits = greedy(model, prompt, n)
    report = mlx_fastops.patch(model)
    rows = {(e.fusion, e.backend) for e in report.entries if e.status == "fused"}
    for fusion in ("attention", "qk_norm_rope", "residual_norm"):
        assert (fusion, "metal") in rows, f"{fusion} not on the Metal backend: {report}"
    try:
        fused, fused_logits = greedy(model, prompt, n)
    finally:
        mlx_fastops.unpatch(model)
    assert fused == stock
    err = mx.max(mx.abs(fused_logits.astype(mx.float32) - stock_logits.astype(mx.float32))).item()
    print(f"max abs logit difference {err}")
    # logits std ~12; fp32 agrees closely, half precision to its rounding noise (~1% of the logits)
    assert err <= (1e-3 if dtype == mx.float32 else 0.5), err
