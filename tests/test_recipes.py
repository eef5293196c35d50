"""Model families are recipe files (mlx_fastops.families): the built-in ones each have a test
model, a recipe added through MLX_FASTOPS_RECIPES patches a family the package does not ship, and
a bad recipe is refused naming its file and the problem."""

import json

import mlx.core as mx
import pytest
from decoding import greedy, prompt_of
from mlx_lm.utils import _get_classes, quantize_model

import mlx_fastops
from mlx_fastops import families, profiler
from mlx_fastops.kernels import data_dir
from mlx_fastops.synthetic import CONFIGS

BUILTIN = sorted(p.stem for p in data_dir("patches").glob("*.json"))
LLAMA = json.loads((data_dir("patches") / "llama.json").read_text())
# mlx-lm's Helium: a family the package has no recipe for, whose decoder layers have Llama's
# attributes and Llama's block (pre-norm, SwiGLU MLP, nn.RoPE; traditional rotation here).
HELIUM = {"model_type": "helium", "hidden_size": 256, "num_hidden_layers": 2, "intermediate_size": 448,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "rms_norm_eps": 1e-5,
          "vocab_size": 1024, "attention_bias": False, "mlp_bias": False,
          "max_position_embeddings": 4096, "rope_theta": 10000.0, "tie_word_embeddings": False}


@pytest.fixture(autouse=True)
def reference_backend(monkeypatch):
    monkeypatch.setenv("MLX_FASTOPS_BACKEND", "reference")
    monkeypatch.delenv("MLX_FASTOPS_DISABLE", raising=False)
    monkeypatch.delenv(families.RECIPES_ENV, raising=False)


def with_recipes(monkeypatch, directory, **recipes):
    """Write `recipes` (family -> recipe dict, or text) into `directory` and name it in the env."""
    directory.mkdir(exist_ok=True)
    for family, recipe in recipes.items():
        text = recipe if isinstance(recipe, str) else json.dumps(recipe)
        (directory / f"{family}.json").write_text(text)
    monkeypatch.setenv(families.RECIPES_ENV, str(directory))


def helium(bits):
    mx.random.seed(0)
    Model, Args = _get_classes(HELIUM)
    model = Model(Args.from_dict(HELIUM))
    if bits:
        model, _ = quantize_model(model, dict(HELIUM), group_size=64, bits=bits)
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("family", BUILTIN)
def test_every_builtin_family_has_a_test_model(family):
    """test_patch.py runs each built-in family through its `<family>-tiny` model."""
    assert f"{family}-tiny" in CONFIGS, f"add a synthetic {family}-tiny config to mlx_fastops/synthetic.py"
    Model, _ = _get_classes(CONFIGS[f"{family}-tiny"])
    assert Model.__module__ in families.recipes()[family]["modules"]


@pytest.mark.parametrize("bits", [None, 4])
def test_recipe_from_the_environment_patches_a_new_family(bits, monkeypatch, tmp_path):
    model = helium(bits)
    with pytest.raises(ValueError, match=r"unsupported model family 'helium'.*MLX_FASTOPS_RECIPES"):
        mlx_fastops.patch(model)
    prompt = prompt_of(model, 2, 20)
    stock_prefill = model(prompt)
    stock, stock_logits = greedy(model, prompt, 16)
    with_recipes(monkeypatch, tmp_path / "recipes", helium=LLAMA)
    report = mlx_fastops.patch(model)
    try:
        assert report.family == "helium" and "family=helium" in str(report)
        assert {e.fusion for e in report.fused} >= {"qkv", "gate_up", "qk_norm_rope", "residual_norm",
                                                    "lm_head", "attention"}
        assert not report.skipped
        # float32 on the reference path: the same arithmetic as stock, bit for bit.
        assert mx.array_equal(model(prompt), stock_prefill)
        fused, fused_logits = greedy(model, prompt, 16)
        assert fused == stock and mx.array_equal(fused_logits, stock_logits)
        assert any(owner.__name__ == "mlx_lm.models.helium" for owner, _, _ in profiler._function_targets())
    finally:
        mlx_fastops.unpatch(model)


def test_alias_and_fusions_of_a_recipe(monkeypatch, tmp_path):
    """A recipe named for no mlx-lm module reaches a model through its aliases; its "fusions"
    list restricts what is fused."""
    recipe = dict(LLAMA, aliases=["mlx_lm.models.helium"], fusions=["qkv", "attention"])
    with_recipes(monkeypatch, tmp_path / "recipes", llama_like=recipe)
    model = helium(None)
    report = mlx_fastops.patch(model)
    mlx_fastops.unpatch(model)
    assert report.family == "llama_like"
    assert {e.fusion for e in report.fused} == {"qkv", "attention"}
    assert ("gate_up", "not in the llama_like recipe") in {(e.fusion, e.reason) for e in report.skipped}


def _without(section, role):
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in LLAMA.items()}
    del out[section][role]
    return out


BAD = [
    # (file stem, content, what the error says)
    ("broken", '{"attention": ', "not valid JSON"),
    ("listed", "[]", "expected a JSON object"),
    ("nomlp", {k: v for k, v in LLAMA.items() if k != "mlp"}, "missing 'mlp'"),
    ("typo", dict(LLAMA, alias=["x"]), r"unknown key\(s\) \['alias'\]"),
    ("noq", _without("attention", "q"), r"'attention': missing role\(s\) \['q'\]"),
    ("extra", dict(LLAMA, mlp=dict(LLAMA["mlp"], gate2="w2")), r"'mlp': unknown role\(s\) \['gate2'\]"),
    ("nonstr", dict(LLAMA, block=dict(LLAMA["block"], mlp=3)), r"'block': role\(s\) \['mlp'\] must name an attribute"),
    ("halfnorm", dict(LLAMA, attention=dict(LLAMA["attention"], q_norm="q_norm")), "'attention': q_norm and k_norm go together"),
    ("alias1", dict(LLAMA, aliases="mlx_lm.models.helium"), "'aliases' must be a list"),
    ("fus", dict(LLAMA, fusions=["qkv", "warp_speed"]), r"'fusions': unknown name\(s\) \['warp_speed'\]"),
    ("llama", LLAMA, "family 'llama' is already defined by .*patches.llama.json"),
    ("mine", dict(LLAMA, aliases=["mlx_lm.models.qwen2"]), "module mlx_lm.models.qwen2 is already patched"),
]


@pytest.mark.parametrize("stem,content,message", BAD, ids=[b[0] for b in BAD])
def test_bad_recipe_names_its_file_and_problem(stem, content, message, monkeypatch, tmp_path):
    with_recipes(monkeypatch, tmp_path, **{stem: content})
    with pytest.raises(ValueError, match=rf"recipe .*{stem}\.json: {message}"):
        families.recipes()


def test_recipe_directory_must_exist(monkeypatch, tmp_path):
    monkeypatch.setenv(families.RECIPES_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match=r"MLX_FASTOPS_RECIPES: '.*nowhere' is not a directory"):
        mlx_fastops.patch(helium(None))
