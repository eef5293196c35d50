"""A patched model stays right when its user changes it through mlx-lm's usual doors (issue 20):
each change made to a patched model gives exactly the outputs (float32, reference path: bit for
bit) of the stock model with the same change, with the fused ops still running; or a clear error
before anything runs wrongly. patch() is atomic. The CUDA decode path follows the same changes
(through the CUDA emulator). mlx-lm's own model tests: tests/test_mlx_lm_models.py."""

import copy
import shutil
from functools import partial

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import pytest
from mlx.utils import tree_flatten
from mlx_lm.tuner.utils import linear_to_lora_layers

import mlx_fastops
from mlx_fastops import fidelity, kernels, profiler
from mlx_fastops.backends import reference
from mlx_fastops.kernels import data_dir
from mlx_fastops.ops.weights import PackedLinear
from mlx_fastops.synthetic import CONFIGS

FAMILIES = sorted(p.stem for p in data_dir("patches").glob("*.json"))
TINY = [f"{family}-tiny" for family in FAMILIES]
LORA = {"rank": 4, "scale": 10.0, "dropout": 0.0}


def prompt(batch, length, seed=0):
    return mx.random.randint(0, CONFIGS["qwen3-tiny"]["vocab_size"], (batch, length), key=mx.random.key(seed))


def model_of(name, bits=4, seed=0, dtype=None):
    return mlx_fastops.synthetic_model(name, bits=bits, seed=seed, dtype=dtype)


def weights_of(name, bits=4, seed=1):
    return list(tree_flatten(model_of(name, bits, seed).parameters()))


def with_lora(model, layers=2, keys=None, dora=False):
    """mlx-lm's adapters on the last `layers` blocks, with non-zero (seeded) low-rank weights."""
    mx.random.seed(3)
    linear_to_lora_layers(model, layers, dict(LORA, keys=keys) if keys else LORA, use_dora=dora)
    for path, m in model.named_modules():
        if type(m).__name__ == "LoRALinear":
            m.lora_b = 0.1 * mx.random.normal(m.lora_b.shape, key=mx.random.key(len(path)))
    return model


def fused_run(model, x):
    """model(x), and how often each fused op ran (an up-to-date model: a change is taken first)."""
    mx.eval(model(x))
    prof = profiler.Profile()
    prof.recording = True
    with profiler.instrument(model, prof):
        out = model(x)
        mx.eval(out)
    return out, {op: len(t) for op, t in prof.times.items()}


def assert_fused(counts, layers):
    for op in ("qkv_proj", "qk_norm_rope", "rms_norm_residual", "lm_head"):
        assert counts.get(op) == (1 if op == "lm_head" else layers), (op, counts)


def _scale_norms(m, _):
    """Norm weights the fused ops take as arguments: post-attention, final, Qwen3's q/k norms."""
    norms = [m.layers[1].post_attention_layernorm, m.model.norm]
    norms += [m.layers[0].self_attn[n] for n in ("q_norm", "k_norm") if n in m.layers[0].self_attn]
    for i, norm in enumerate(norms):
        norm.weight = (1.5 - 0.25 * i) * norm.weight


# Each change as users make it, applied alike to the stock and the patched model.
CHANGES = {
    "load_weights": lambda m, n: m.load_weights(weights_of(n)),
    "update": lambda m, n: m.update({"model": {"layers": [{}, model_of(n, seed=2).layers[1].parameters()]}}),
    "assign k_proj": lambda m, n: setattr(m.layers[0].self_attn.k_proj, "weight",
                                          model_of(n, seed=2).layers[0].self_attn.k_proj.weight),
    "assign norms": _scale_norms,
    "embedding": lambda m, n: setattr(m.model.embed_tokens, "scales", 1.1 * m.model.embed_tokens.scales),
    "set_dtype": lambda m, n: m.set_dtype(mx.float16),
    "lora after patch": lambda m, n: with_lora(m),
    "lora on some layers": lambda m, n: with_lora(m, layers=1, keys=["self_attn.q_proj", "self_attn.v_proj"]),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
@pytest.mark.parametrize("name", TINY)
def test_change_while_patched_equals_stock_with_the_change(name, change):
    x = prompt(2, 12)
    stock = model_of(name)
    CHANGES[change](stock, name)
    want = stock(x)
    model = model_of(name)
    mlx_fastops.patch(model)
    CHANGES[change](model, name)
    got, counts = fused_run(model, x)
    assert got.dtype == want.dtype and mx.array_equal(got, want)
    assert_fused(counts, len(model.layers))
    assert mlx_fastops.unpatch(model) and mx.array_equal(model(x), want)


# Weights reloaded around an unpatch: patch, unpatch, reload, patch (the order the README once
# recommended); patch, reload, unpatch before any call, patch.
RELOADS = {"while unpatched": ("patch", "unpatch", "reload", "patch"),
           "patched, no call since": ("patch", "reload", "unpatch", "patch")}


@pytest.mark.parametrize("order", sorted(RELOADS))
@pytest.mark.parametrize("name", TINY)
def test_reload_around_unpatch(name, order):
    x = prompt(1, 9)
    model = model_of(name)
    steps = {"patch": mlx_fastops.patch, "unpatch": mlx_fastops.unpatch,
             "reload": lambda m: m.load_weights(weights_of(name))}
    for step in RELOADS[order]:
        steps[step](model)
    assert mx.array_equal(fused_run(model, x)[0], model_of(name, seed=1)(x))


def test_repatch_of_an_unchanged_model_takes_the_same_fused_state():
    model = model_of("qwen3-tiny")
    x = prompt(1, 9)
    report = mlx_fastops.patch(model)
    blocks, stacked = list(model.model.layers), model.layers[0].self_attn.qkv_weights.weight
    mlx_fastops.unpatch(model)
    assert mlx_fastops.patch(model) is report
    assert all(a is b for a, b in zip(model.model.layers, blocks))
    assert model.layers[0].self_attn.qkv_weights.weight is stacked
    assert mx.array_equal(fused_run(model, x)[0], model_of("qwen3-tiny")(x))


@pytest.mark.parametrize("name", TINY)
def test_quantize_after_patch(name):
    """nn.quantize on a patched float model: the quantised model's outputs, fused; after unpatch
    the model is still the quantised one."""
    x = prompt(1, 9)
    stock = model_of(name, bits=None)
    nn.quantize(stock)
    model = model_of(name, bits=None)
    mlx_fastops.patch(model)
    nn.quantize(model)
    got, counts = fused_run(model, x)
    assert mx.array_equal(got, stock(x)) and counts.get("qkv_proj") == len(model.layers)
    assert any(e.reason == "" and e.fusion == "qkv" for e in mlx_fastops.patch(model).fused)
    mlx_fastops.unpatch(model)
    assert type(model.layers[0].self_attn.q_proj) is nn.QuantizedLinear and mx.array_equal(model(x), stock(x))


@pytest.mark.parametrize("name", TINY)
def test_model_with_adapters_patches_and_unpatches(name):
    """A model that has LoRA layers (as mlx_lm.load(path, adapter_path=...) returns it), on some
    layers only: patched, the adapters run on the fused path; unpatch restores it exactly."""
    x = prompt(1, 9)
    model = with_lora(model_of(name), layers=1)
    want = model(x)
    report = mlx_fastops.patch(model)
    assert mlx_fastops.is_patched(model) and not report.skipped
    assert {e.where for e in report.fused if "LoRA" in e.reason} == {"layers.1.self_attn", "layers.1.mlp"}
    got, counts = fused_run(model, x)
    assert mx.array_equal(got, want) and counts.get("gate_up_silu") == len(model.layers)
    mlx_fastops.unpatch(model)
    assert type(model.layers[1].self_attn.q_proj).__name__ == "LoRALinear" and mx.array_equal(model(x), want)


def test_other_adapters_stay_stock():
    """DoRA computes another function of its layer: those projections stay stock, reported."""
    x = prompt(1, 9)
    want = with_lora(model_of("llama-tiny"), layers=1, dora=True)(x)
    model = model_of("llama-tiny")
    mlx_fastops.patch(model)
    with_lora(model, layers=1, dora=True)
    got, counts = fused_run(model, x)
    assert mx.array_equal(got, want) and counts.get("qkv_proj") == 1
    skipped = {(e.where, e.fusion, e.reason) for e in mlx_fastops.patch(model).skipped}
    assert skipped == {("layers.1.self_attn", "qkv", "layer type DoRALinear"),
                       ("layers.1.mlp", "gate_up", "layer type DoRALinear")}


def _loss(model, x):
    return nn.losses.cross_entropy(model(x[:, :-1]), x[:, 1:]).mean()


@pytest.mark.parametrize("name", TINY)
def test_gradients(name):
    """nn.value_and_grad through a patched model: the stacked weights follow the traced
    parameters, so every gradient is stock's up to float rounding (the fused matmul's backward
    adds up in another order). After model.train() the fused modules compute the stock
    composition: stock's gradients bit for bit; model.eval() fuses again."""
    x = prompt(2, 10)
    stock = model_of(name, bits=None)
    loss, grads = nn.value_and_grad(stock, _loss)(stock, x)
    want = dict(tree_flatten(grads))
    model = model_of(name, bits=None)
    mlx_fastops.patch(model)
    got_loss, got = nn.value_and_grad(model, _loss)(model, x)
    got = dict(tree_flatten(got))
    assert got_loss.item() == loss.item() and got.keys() == want.keys()
    for k, g in want.items():
        norm = mx.linalg.norm(g).item()
        assert norm > 0 and mx.linalg.norm(got[k] - g).item() <= 1e-5 * norm, k
    model.train()
    _, trained = nn.value_and_grad(model, _loss)(model, x)
    assert all(mx.array_equal(g, want[k]) for k, g in tree_flatten(trained))
    model.eval()
    assert_fused(fused_run(model, x[:, :-1])[1], len(model.layers))


def _train(model, patched, steps=4):
    """mlx-lm's trainer's loop: freeze, adapters, train(), a compiled step whose state is the
    model's (its arrays are written back without an item write), an eval() pass in between."""
    if patched:
        mlx_fastops.patch(model)
    model.freeze()
    with_lora(model)
    model.train()
    opt = optim.Adam(learning_rate=1e-2)
    grad = nn.value_and_grad(model, _loss)
    state = [model.state, opt.state]
    x = prompt(2, 12)

    @partial(mx.compile, inputs=state, outputs=state)
    def step(x):
        loss, g = grad(model, x)
        opt.update(model, g)
        return loss

    losses = []
    for i in range(steps):
        losses.append(step(x).item())
        if i == 1:
            model.eval()
            losses.append(_loss(model, x).item())
            model.train()
    model.eval()
    return losses, fused_run(model, x)


def test_lora_training_loop():
    stock_losses, (stock_out, _) = _train(model_of("qwen3-tiny"), False)
    losses, (out, counts) = _train(model_of("qwen3-tiny"), True)
    assert losses == stock_losses and mx.array_equal(out, stock_out)
    assert_fused(counts, 2)


VL = [("qwen3_vl", "qwen3-tiny"), ("qwen2_vl", "qwen2-tiny"), ("pixtral", "llama-tiny")]


@pytest.mark.parametrize("wrapper,text", VL, ids=[w for w, _ in VL])
def test_vision_language_wrapper(wrapper, text):
    import importlib

    mod = importlib.import_module(f"mlx_lm.models.{wrapper}")
    model = mod.Model(mod.ModelArgs.from_dict({"model_type": wrapper, "text_config": dict(CONFIGS[text])}))
    x = prompt(1, 9)
    want = model(x)
    report = mlx_fastops.patch(model)
    assert report.family == text.removesuffix("-tiny") and not report.skipped
    got, counts = fused_run(model, x)
    assert mx.array_equal(got, want)
    assert_fused(counts, len(model.layers))
    mlx_fastops.unpatch(model)


def test_wrapper_of_another_family_is_refused():
    from mlx_lm.models import qwen3_vl_moe

    text = dict(CONFIGS["qwen3-tiny"], model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                decoder_sparse_step=1, mlp_only_layers=[], moe_intermediate_size=16, norm_topk_prob=True)
    model = qwen3_vl_moe.Model(qwen3_vl_moe.ModelArgs(model_type="qwen3_vl_moe", text_config=text))
    with pytest.raises(ValueError, match="unsupported model family.*" + ".*".join(FAMILIES)):
        mlx_fastops.patch(model)


def test_deepcopy_is_a_model_of_its_own():
    x = prompt(1, 9)
    model = model_of("llama-tiny")
    mlx_fastops.patch(model)
    before = model(x)
    twin = copy.deepcopy(model)
    twin.load_weights(weights_of("llama-tiny"))
    assert mx.array_equal(fused_run(twin, x)[0], model_of("llama-tiny", seed=1)(x))
    assert mx.array_equal(model(x), before)
    assert mlx_fastops.unpatch(twin) and mlx_fastops.unpatch(model)


def fingerprint(model):
    """Every module (path, object, class, attribute names) and every array (path, object)."""
    mods = [(path, id(m), type(m), sorted(vars(m))) for path, m in model.named_modules()]
    return mods, [(path, id(a)) for path, a in tree_flatten(model.parameters())], sorted(vars(model))


class _BrokenPath:
    """A backend decode path whose install fails (after every block took it)."""
    cache_types = (object,)

    def block(self, fused_block, disabled):
        return self, None

    def install(self, model, fasts, disabled):
        raise RuntimeError("injected failure")


def failing(fn, calls, when=lambda *a, **k: True):
    """fn, raising instead on its `calls`-th call for which `when` holds."""
    count = [0]

    def wrapped(*a, **k):
        count[0] += when(*a, **k)
        if count[0] == calls:
            raise RuntimeError("injected failure")
        return fn(*a, **k)
    return wrapped


# Where patch() fails (each a monkeypatch): every earlier change must be undone.
FAILURES = {
    "stacking layer 1's gate/up": lambda mp: mp.setattr(PackedLinear, "concat", failing(PackedLinear.concat, 4)),
    "selecting the head op": lambda mp: mp.setattr(
        "mlx_fastops.ops.select", failing(mlx_fastops.ops.select, 1, when=lambda op, *a, **k: op == "lm_head")),
    "installing a decode path": lambda mp: mp.setattr(reference, "DECODE_PATH", _BrokenPath()),
    "warming up": lambda mp: mp.setattr("mlx_fastops.patcher._warm_up", failing(lambda *a: None, 1)),
}


@pytest.mark.parametrize("where", sorted(FAILURES))
def test_patch_is_atomic(where, monkeypatch):
    model = with_lora(model_of("qwen3-tiny"), layers=1)
    x = prompt(1, 9)
    want, before = model(x), fingerprint(model)
    with monkeypatch.context() as mp:
        FAILURES[where](mp)
        with pytest.raises(RuntimeError, match="injected failure") as err:
            mlx_fastops.patch(model)
    assert "the model is unchanged" in "".join(getattr(err.value, "__notes__", ["the model is unchanged"]))
    assert fingerprint(model) == before and not mlx_fastops.is_patched(model)
    assert mx.array_equal(model(x), want)
    mlx_fastops.patch(model)
    assert mx.array_equal(fused_run(model, x)[0], want)


def test_failed_rebuild_leaves_the_patch_as_it_was(monkeypatch):
    model = model_of("qwen2-tiny")
    x = prompt(1, 9)
    mlx_fastops.patch(model)
    model.load_weights(weights_of("qwen2-tiny"))
    before = fingerprint(model)
    with monkeypatch.context() as mp:
        mp.setattr(PackedLinear, "concat", failing(PackedLinear.concat, 3))
        with pytest.raises(RuntimeError, match="injected failure"):
            model(x)
    assert fingerprint(model) == before and mlx_fastops.is_patched(model)
    assert mx.array_equal(fused_run(model, x)[0], model_of("qwen2-tiny", seed=1)(x))


# --- the CUDA decode path (one launch per block, compiled step) through the CUDA emulator ---


@pytest.fixture
def cuda_backend(monkeypatch):
    monkeypatch.setenv("MLX_FASTOPS_BACKEND", "cuda")
    if mx.cuda.is_available():
        yield
        return
    if shutil.which("g++") is None:
        pytest.skip("no CUDA device and no g++ for the CUDA emulator")
    import cuda_emu

    with kernels.use_cuda_factory(cuda_emu.cuda_kernel):
        yield


@pytest.mark.cuda
def test_cuda_decode_path_follows_the_model(cuda_backend):
    """The compiled decode step (run eagerly: the emulator cannot be traced) after load_weights
    is the step of a model patched with those weights, bit for bit; so is a deepcopy's; in
    training mode the model computes stock's logits. LoRA adapters added later:
    their block leaves the one-launch layer (the report says why), the compiled step steps aside,
    and the outputs are stock's with the same adapters, within bf16 rounding."""
    bf16 = partial(model_of, "qwen3-tiny", dtype=mx.bfloat16)
    prompt_, tokens = prompt(1, 20)[0], [7, 99, 1234]
    mx.disable_compile()
    try:
        model, other = bf16(seed=4), bf16(seed=5)
        mlx_fastops.patch(model)
        before = fidelity.forced_logits(model, prompt_, tokens)
        mlx_fastops.patch(other)
        want = fidelity.forced_logits(other, prompt_, tokens)
        model.load_weights(list(tree_flatten(other.parameters())))
        model.model.__dict__.pop("_fastops_off", None)
        got = fidelity.forced_logits(model, prompt_, tokens)
        assert "_fastops_off" in model.model.__dict__, "the compiled step did not run"
        assert mx.array_equal(got, want) and not mx.array_equal(got, before)
        model.train()   # the stock composition, stock's logits bit for bit
        assert mx.array_equal(fidelity.forced_logits(model, prompt_, tokens),
                              fidelity.forced_logits(bf16(seed=5), prompt_, tokens))
        model.eval()
        twin = copy.deepcopy(model)   # a compiled step cannot be copied: the copy rebuilds its own
        assert mx.array_equal(fidelity.forced_logits(twin, prompt_, tokens), want)
        assert "_fastops_off" in twin.model.__dict__ and twin.model._fastops_step.owners[0] is twin.model.layers[0]
        with_lora(model, layers=1)
        got = fidelity.forced_logits(model, prompt_, tokens)
        report = mlx_fastops.patch(model)
    finally:
        mx.enable_compile()
    rows = {(e.where, e.fusion): (e.status, e.reason) for e in report.entries}
    assert rows["layers.1", "fast_decode"][0] == "skipped" and "LoRA" in rows["layers.1", "fast_decode"][1]
    assert rows["layers.0", "fast_decode"][0] == "fused" and rows["model", "compile"][0] == "skipped"
    # Judged against the float32 evaluation of the same quantised model with the same adapters
    # (stock adds its bf16 GEMVs up in bf16, the kernels in fp32).
    oracle = fidelity.forced_logits(fidelity.fp32_oracle(with_lora(bf16(seed=5), layers=1)), prompt_, tokens)
    stock = fidelity.against(fidelity.forced_logits(with_lora(bf16(seed=5), layers=1), prompt_, tokens), oracle)
    fused = fidelity.against(got, oracle)
    print(f"vs float32: stock {stock}, patched {fused}")
    assert fused["mean_abs"] <= 1.1 * stock["mean_abs"] and fused["top1_agree"] >= stock["top1_agree"]
    mlx_fastops.unpatch(model)
