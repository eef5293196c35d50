"""patch(model) / unpatch(model): swap an mlx-lm model's modules for fused ones, in place.

The recipe of each family (patches/<family>.json) names the attributes that hold q/k/v/o,
gate/up/down, norms and RoPE. Families are recognised by the Python module of the model's layer
classes (mistral checkpoints load as mlx_lm.models.llama), not by config strings.
"""

import json
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from . import config, ops
from .kernels import data_dir
from .modules import FusedAttention, FusedBlock, FusedMLP, head_class
from .ops.weights import PackedLinear, RopeSpec

_STATE = "_mlx_fastops_state"
_PARKED = "_mlx_fastops_parked"


def recipes():
    """All family recipes, keyed by family name."""
    out = {}
    for path in sorted(data_dir("patches").glob("*.json")):
        recipe = json.loads(path.read_text())
        out[recipe["family"]] = recipe
    return out


@dataclass
class Entry:
    where: str  # e.g. "layers.3.self_attn" or "lm_head"
    fusion: str
    status: str  # "fused" | "skipped"
    backend: str = ""
    reason: str = ""


@dataclass
class PatchReport:
    """What patch() fused where, on which backend, and what it skipped and why."""

    family: str
    backend: str
    entries: list = field(default_factory=list)

    def add(self, where, fusion, status, backend="", reason=""):
        self.entries.append(Entry(where, fusion, status, backend, reason))

    @property
    def fused(self):
        return [e for e in self.entries if e.status == "fused"]

    @property
    def skipped(self):
        return [e for e in self.entries if e.status == "skipped"]

    def summary(self):
        """Rows (fusion, status, backend, reason, count), one per distinct outcome."""
        rows = {}
        for e in self.entries:
            key = (e.fusion, e.status, e.backend, e.reason)
            rows[key] = rows.get(key, 0) + 1
        return [(*k, n) for k, n in rows.items()]

    def __str__(self):
        lines = [f"mlx_fastops patch: family={self.family} backend={self.backend}",
                 "| fusion | status | backend | count | note |", "|---|---|---|---|---|"]
        for fusion, status, backend, reason, n in self.summary():
            lines.append(f"| {fusion} | {status} | {backend or '-'} | {n} | {reason} |")
        return "\n".join(lines)

    def to_dict(self):
        return {"family": self.family, "backend": self.backend,
                "summary": [dict(zip(("fusion", "status", "backend", "reason", "count"), r))
                            for r in self.summary()]}


def _decoder_layers(model):
    """The list that holds the decoder blocks. Not `model.layers`: for qwen2 that property returns
    a fresh slice (`pipeline_layers`), and assigning into it changes nothing."""
    return model.model.layers


def _family(model):
    layers = getattr(model, "layers", None)
    if not isinstance(model, nn.Module) or not layers:
        raise TypeError(
            f"patch() expects an mlx-lm model (an nn.Module with .layers), got {type(model).__name__}")
    module = type(layers[0]).__module__
    known = recipes()
    for recipe in known.values():
        if module in recipe["modules"]:
            return recipe
    model_type = getattr(model, "model_type", module)
    raise ValueError(f"unsupported model family {model_type!r} ({module}); "
                     f"mlx_fastops supports {sorted(known)} (mistral loads as llama)")


class _Patcher:
    def __init__(self, recipe, backend, disabled, report):
        self.recipe, self.backend, self.disabled, self.report = recipe, backend, disabled, report

    def off(self, fusion):
        """Why `fusion` is not to be applied (switched off, or not in the family's recipe), or None."""
        if fusion in self.disabled:
            return "disabled"
        if fusion not in self.recipe["fusions"]:
            return f"not in the {self.recipe['family']} recipe"
        return None

    def select(self, where, fusion, op, **info):
        """The op function for `fusion` (its backend recorded in the report); None if off."""
        reason = self.off(fusion)
        if reason:
            self.skip(where, fusion, reason)
            return None
        fn, used, reason = ops.select(op, self.backend, **info)
        self.report.add(where, fusion, "fused", used, reason or "")
        return fn

    def skip(self, where, fusion, reason):
        self.report.add(where, fusion, "skipped", reason=reason)

    def stack(self, where, fusion, modules):
        """The layers stacked into one PackedLinear, or None (off or unsupported, reported)."""
        reason = self.off(fusion) or PackedLinear.unsupported(modules)
        if reason:
            self.skip(where, fusion, reason)
            return None
        return PackedLinear.stack(modules)

    def attention(self, where, attn):
        names = self.recipe["attention"]
        ops_ = {}
        w = self.stack(where, "qkv", [attn[names[r]] for r in ("q", "k", "v")])
        if w is not None:
            ops_["qkv"] = self.select(where, "qkv", "qkv_proj", **w.info())
        rope = RopeSpec.from_module(attn[names["rope"]])
        # From the weights, never hidden_size / n_heads (Qwen3-0.6B: 128, not 1024 / 16).
        head_dim = attn[names["q"]].weight.shape[0] // attn.n_heads
        if rope is None:
            self.skip(where, "qk_norm_rope", f"RoPE variant {type(attn[names['rope']]).__name__}")
        else:
            fn = self.select(where, "qk_norm_rope", "qk_norm_rope", head_dim=head_dim,
                             rope=rope, norm="q_norm" in names)
            if fn is not None:
                ops_["norm_rope"] = fn
        reason = self.off("attention")
        if reason:
            self.skip(where, "attention", reason)
        else:
            info = {"head_dim": head_dim, "gqa": attn.n_heads // attn.n_kv_heads}
            used, notes = set(), []
            for key, op in (("decode", "decode_attention"), ("prefill", "flash_attention"),
                            ("quantized", "quantized_attention")):
                ops_[key], backend, why = ops.select(op, self.backend, **info)
                used.add(backend)
                notes += [f"{op}: {why}"] if why else []
            self.report.add(where, "attention", "fused", "+".join(sorted(used)), "; ".join(notes))
        return FusedAttention(attn, names, ops_, qkv_weights=w, rope=rope)

    def mlp(self, where, mlp):
        names = self.recipe["mlp"]
        w = self.stack(where, "gate_up", [mlp[names["gate"]], mlp[names["up"]]])
        if w is None:
            return mlp
        return FusedMLP(mlp, names, self.select(where, "gate_up", "gate_up_silu", **w.info()), w)

    def block(self, where, block):
        names = self.recipe["block"]
        attn = self.attention(f"{where}.{names['attention']}", block[names["attention"]])
        mlp = self.mlp(f"{where}.{names['mlp']}", block[names["mlp"]])
        norm = block[names["post_norm"]]
        if type(norm) is not nn.RMSNorm:
            self.skip(where, "residual_norm", f"norm type {type(norm).__name__}")
            add_norm = None
        else:
            add_norm = self.select(where, "residual_norm", "rms_norm_residual",
                                   hidden=norm.weight.shape[0], dtype=norm.weight.dtype)
        fb = FusedBlock(block, names, {"attention": attn, "mlp": mlp}, add_norm)
        self.fast_block(where, fb)
        return fb

    def fast_block(self, where, fb):
        """A backend's whole-block decode path (CUDA: one launch per block), if it has one."""
        hook = None if self.backend == "reference" else getattr(ops.backend_module(self.backend), "fast_block", None)
        if hook is None:
            return
        if "fast_decode" in self.disabled:
            self.skip(where, "fast_decode", "disabled")
            return
        fn, reason = hook(fb, disabled=self.disabled)
        if fn is None:
            self.skip(where, "fast_decode", reason)
        else:
            object.__setattr__(fb, "fast_fn", fn)
            self.report.add(where, "fast_decode", "fused", self.backend)
            if fn.one_launch:
                self.report.add(where, "layer_kernel", "fused", self.backend)
            else:
                self.skip(where, "layer_kernel", "disabled")
            if fn.group_layers:
                self.report.add(where, "layer_groups", "fused", self.backend)
            else:
                self.skip(where, "layer_groups", fn.group_layers_off)

    def head(self, model):
        """Returns (object, original class) for the class swap, or None."""
        tied = "lm_head" not in model
        obj, where = (model.model.embed_tokens, "model.embed_tokens") if tied else (model.lm_head, "lm_head")
        reason = self.off("lm_head") or PackedLinear.unsupported([obj])
        if reason:
            self.skip(where, "lm_head", reason)
            return None
        w = PackedLinear.from_embedding(obj) if tied else PackedLinear.stack([obj])
        fn = self.select(where, "lm_head", "lm_head", **w.info())
        original = type(obj)
        obj.__class__ = head_class(original)
        object.__setattr__(obj, "_fastops_head_fn", lambda x: fn(x, w))
        return obj, original


def patch(model, disable=()):
    """Swap the model's modules for fused ones in place; returns a PatchReport.

    Patching an already patched model is a no-op that returns the first report. `disable` takes
    fusion names (see mlx_fastops.config.FUSIONS; a list or a comma-separated string), added to
    MLX_FASTOPS_DISABLE.
    """
    state = model.__dict__.get(_STATE) if isinstance(model, nn.Module) else None
    if state is not None:
        return state["report"]
    recipe = _family(model)
    disabled = config.disabled(disable)
    backend = config.backend_name()
    key = (backend, frozenset(disabled))
    parked = model.__dict__.pop(_PARKED, None)
    if parked is not None and parked["key"] == key:
        # Re-patch after unpatch with the same settings: reuse the fused modules (no re-stacking).
        _swap_in(model, parked)
        return parked["report"]
    report = PatchReport(recipe["family"], backend)
    p = _Patcher(recipe, backend, disabled, report)
    layers = _decoder_layers(model)
    originals = list(layers)
    with config.disabling(disabled):
        for i, block in enumerate(originals):
            layers[i] = p.block(f"layers.{i}", block)
        head = p.head(model)
    # Backend decode fast path (CUDA): its cache class and its compiled whole decode step.
    cache_hook = _install_cache(model, backend, layers)
    step = _install_step(model, backend, layers, disabled, report) if cache_hook else None
    mx.eval(model.parameters())
    fused = list(layers)
    object.__setattr__(model, _STATE, {"report": report, "layers": originals, "head": head,
                                       "fused": fused, "key": key,
                                       "cache_hook": cache_hook, "step": step})
    # Warm up the chosen kernels on this model's shapes, so the first real call does not compile.
    _warm_up(model, backend)
    return report


def _install_cache(model, backend, layers):
    """Backends with a fast decode path get their cache class from make_prompt_cache: set
    model.make_cache (instance attribute) when every stock cache would be a plain KVCache."""
    if not any(getattr(b, "fast_fn", None) is not None for b in layers):
        return False
    mod = ops.backend_module(backend)
    make = getattr(mod, "make_cache", None)
    if make is None:
        return False
    if hasattr(model, "make_cache"):
        from mlx_lm.models.cache import KVCache
        if any(type(c) is not KVCache for c in model.make_cache()):
            return False
    fn = lambda: make(model)
    object.__setattr__(model, "make_cache", fn)
    return fn


def _install_step(model, backend, layers, disabled, report):
    """A backend's compiled whole decode step (CUDA), if it has one; returns the undo state."""
    mod = ops.backend_module(backend)
    hook = getattr(mod, "fast_model", None)
    if hook is None:
        return None
    if "compile" in disabled:
        report.add("model", "compile", "skipped", reason="disabled")
        return None
    done, reason = hook(model, list(layers))
    if done is None:
        report.add("model", "compile", "skipped", reason=reason)
        return None
    report.add("model", "compile", "fused", backend)
    return done  # (inner model object, stock class, fast class)


def _warm_up(model, backend):
    if backend == "reference":
        return
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    for n in (4, 1):
        mx.eval(model(mx.zeros((1, n), dtype=mx.int32), cache=cache))


def unpatch(model):
    """Restore the original module objects; returns True if the model was patched."""
    state = model.__dict__.pop(_STATE, None)
    if state is None:
        return False
    layers = _decoder_layers(model)
    for i, block in enumerate(state["layers"]):
        layers[i] = block
    if state.get("cache_hook"):
        model.__dict__.pop("make_cache", None)
    if state.get("step"):
        obj, original, _ = state["step"]
        obj.__class__ = original
    if state["head"] is not None:
        obj, original = state["head"]
        state["head_fn"] = obj.__dict__.pop("_fastops_head_fn")
        obj.__class__ = original
    object.__setattr__(model, _PARKED, state)
    return True


def _swap_in(model, state):
    layers = _decoder_layers(model)
    for i, block in enumerate(state["fused"]):
        layers[i] = block
    if state["head"] is not None:
        obj, original = state["head"]
        obj.__class__ = head_class(original)
        object.__setattr__(obj, "_fastops_head_fn", state.pop("head_fn"))
    if state.get("cache_hook"):
        object.__setattr__(model, "make_cache", state["cache_hook"])
    if state.get("step"):
        obj, _, fast_cls = state["step"]
        obj.__class__ = fast_cls
    object.__setattr__(model, _STATE, state)


def is_patched(model):
    return _STATE in model.__dict__
