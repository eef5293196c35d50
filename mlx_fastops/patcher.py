"""patch(model) / unpatch(model): swap an mlx-lm model's modules for fused ones, in place.

The recipe of each family (patches/<family>.json, format in mlx_fastops.families) names the
attributes that hold q/k/v/o, gate/up/down, norms and RoPE. A model's family is the recipe whose
modules (mlx_lm.models.<family> and the recipe's aliases) hold its layer classes: mistral
checkpoints load as mlx_lm.models.llama and are patched as llama; config strings are not read.
MLX_FASTOPS_RECIPES adds directories of recipes (os.pathsep-separated) to the package's patches/.
"""

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from . import config, ops
from .families import RECIPES_ENV, recipes
from .modules import FusedAttention, FusedBlock, FusedMLP, head_class
from .ops.weights import PackedLinear, RopeSpec

_STATE = "_mlx_fastops_state"
_PARKED = "_mlx_fastops_parked"


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
    raise ValueError(f"unsupported model family {model_type!r} ({module}): mlx_fastops has recipes for "
                     f"{sorted(known)}; add one as <family>.json in a directory named by {RECIPES_ENV}")


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

    def switched_off(self):
        """Every fusion name that is off for this patch (disabled or not in the recipe)."""
        return {f for f in config.FUSIONS if self.off(f)}

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
        """The backend's whole-block decode path for this block, if it has one (DecodePath.block)."""
        path = ops.backend_module(self.backend).DECODE_PATH
        if path is None:
            return
        reason = self.off("fast_decode")
        if reason:
            self.skip(where, "fast_decode", reason)
            return
        fast, reason = path.block(fb, self.switched_off())
        if fast is None:
            self.skip(where, "fast_decode", reason)
        else:
            object.__setattr__(fb, "fast_fn", fast)
            self.report.add(where, "fast_decode", "fused", self.backend)

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
    for i, block in enumerate(originals):
        layers[i] = p.block(f"layers.{i}", block)
    head = p.head(model)
    decode = _install_decode_path(model, backend, layers, p.switched_off(), report)
    mx.eval(model.parameters())
    fused = list(layers)
    object.__setattr__(model, _STATE, {"report": report, "layers": originals, "head": head,
                                       "fused": fused, "key": key, "decode": decode})
    # Warm up the chosen kernels on this model's shapes, so the first real call does not compile.
    _warm_up(model, backend)
    return report


def _install_decode_path(model, backend, layers, disabled, report):
    """The backend's whole-model decode path (DecodePath.install) once its blocks are fused;
    returns what unpatch removes, or None."""
    path = ops.backend_module(backend).DECODE_PATH
    fasts = [b.fast_fn for b in layers]
    if path is None or not any(fasts):
        return None
    installed, rows = path.install(model, fasts, disabled)
    for fusion, status, note in rows:
        report.add("model", fusion, status, backend if status == "fused" else "", note)
    return installed


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
    if state["decode"] is not None:
        state["decode"].remove()
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
    if state["decode"] is not None:
        state["decode"].restore()
    object.__setattr__(model, _STATE, state)


def is_patched(model):
    return _STATE in model.__dict__
