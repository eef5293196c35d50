"""patch(model) / unpatch(model): swap an mlx-lm model's modules for fused ones, in place.

The recipe of each family (patches/<family>.json, format in mlx_fastops.families) names the
attributes that hold q/k/v/o, gate/up/down, norms and RoPE. A model's family is the recipe whose
modules (mlx_lm.models.<family> and the recipe's aliases) hold its layer classes: mistral
checkpoints load as mlx_lm.models.llama and are patched as llama; config strings are not read.
A vision-language wrapper (qwen2_vl, qwen3_vl, pixtral, ...) is patched in its `language_model`.
MLX_FASTOPS_RECIPES adds directories of recipes (os.pathsep-separated) to the package's patches/.

The fused state (stacked weights, selected ops, a backend's decode path) follows the model: a
Watch (mlx_fastops.modules) sees every write into the modules it was built from, and the next
fused call rebuilds it from the current modules (mlx_fastops.state). Every change patch() and a
rebuild make goes through a Journal, so a failure part-way leaves the model exactly as it was.
"""

from dataclasses import dataclass, field
from functools import partial

import mlx.core as mx
import mlx.nn as nn

from . import config, ops, tuner
from .families import RECIPES_ENV, recipes
from .modules import FusedAttention, FusedMLP, head_class
from .ops.weights import PackedLinear, RopeSpec, adapter_of, out_features
from .state import Journal, PatchState, decoder_layers

_STATE = "_mlx_fastops_state"
_PARKED = "_mlx_fastops_parked"

LORA_NOTE = "LoRA adapters: low-rank deltas added to the fused projection"


def _notes(*notes):
    return "; ".join(n for n in notes if n)


def shard_note(w, reduced_by):
    """The report's note on stacked column shards (a tensor-parallel model), or ''."""
    if w.group is None:
        return ""
    return f"column shards of a {w.group.size()}-rank group; {reduced_by} row-sharded, then mlx-lm's all_sum"


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
    tuning: object = None   # tuner.Tuning where patch() tuned (measured or cached), else None

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
        if self.tuning is not None:
            lines += ["", self.tuning.table()]
        return "\n".join(lines)

    def to_dict(self):
        return {"family": self.family, "backend": self.backend,
                "summary": [dict(zip(("fusion", "status", "backend", "reason", "count"), r))
                            for r in self.summary()],
                "tuning": self.tuning.to_dict() if self.tuning is not None else None}


def text_model(model):
    """The mlx-lm text model: `model` itself (its decoder stack at .model: embed_tokens, layers,
    norm), or a vision-language wrapper's `language_model`; None if neither."""
    for text in (model, model.get("language_model")):
        inner = text.get("model") if isinstance(text, nn.Module) else None
        if isinstance(inner, nn.Module) and isinstance(inner.get("layers"), list) and "embed_tokens" in inner:
            return text
    return None


def _family(model):
    layers = getattr(model, "layers", None)
    if not isinstance(model, nn.Module) or not layers:
        raise TypeError(
            f"patch() expects an mlx-lm model (an nn.Module with .layers), got {type(model).__name__}")
    module = type(layers[0]).__module__
    known = recipes()
    for recipe in known.values():
        if module in recipe["modules"] and text_model(model) is not None:
            return recipe
    model_type = getattr(model, "model_type", module)
    raise ValueError(f"unsupported model family {model_type!r} ({module}): mlx_fastops has recipes for "
                     f"{sorted(known)}; add one as <family>.json in a directory named by {RECIPES_ENV}")


class Planner:
    """Sets one patch's fused modules up from their current children (PatchState.build calls it
    per block, then for the head); every change through the journal, every outcome in the report."""

    def __init__(self, recipe, backend, disabled, report, journal, tuning):
        self.recipe, self.backend, self.disabled, self.report = recipe, backend, disabled, report
        self.journal = journal
        self.reasons = tuning.reasons() if tuning is not None else {}
        stock = tuner.stock_rows(tuning.decisions.get("prefill")) if tuning is not None else None
        # (lo, hi): the prompt rows lo < rows <= hi the tuner leaves to stock; none of the decode rows
        self.prefill_stock = ((max(stock[0], ops.DECODE_ROWS), stock[1]) if stock and stock[1] > ops.DECODE_ROWS
                              else None)

    def off(self, fusion):
        """Why `fusion` is not to be applied (switched off: by the user, or by the tuner, which
        says why in `reasons`; or not in the family's recipe), or None."""
        if fusion in self.disabled:
            return self.reasons.get(fusion, "disabled")
        if fusion not in self.recipe["fusions"]:
            return f"not in the {self.recipe['family']} recipe"
        return None

    def switched_off(self):
        """Every fusion name that is off for this patch (disabled or not in the recipe)."""
        return {f for f in config.FUSIONS if self.off(f)}

    def select(self, where, fusion, op, note="", **info):
        """The op function for `fusion` (its backend recorded in the report); None if off."""
        reason = self.off(fusion)
        if reason:
            self.skip(where, fusion, reason)
            return None
        fn, used, reason = ops.select(op, self.backend, **info)
        # The tuner's verdict on `prefill` comes from prompt chunks, which never evaluate the head
        # (mlx-lm's prefill evaluates the cache): lm_head's rows (batched decode's logits) follow the
        # user's switch only.
        by_tuner = op == "lm_head" and "prefill" in self.reasons
        stock = None if op == "lm_head" else self.prefill_stock
        if op in ops.PREFILL_OPS and used != "reference" and self.off("prefill") and not by_tuner:
            fn, note = ops.decode_rows_only(fn, op), _notes(note, "prefill off: stock")
        elif op in ops.PREFILL_OPS and used != "reference" and stock is not None:
            fn = ops.decode_rows_only(fn, op, stock)
            note = _notes(note, f"prefill tuned: stock for {stock[0] + 1}-{stock[1]} rows")
        self.report.add(where, fusion, "fused", used, _notes(note, reason))
        return fn

    def skip(self, where, fusion, reason):
        self.report.add(where, fusion, "skipped", reason=reason)

    def stack(self, where, fusion, modules):
        """The layers stacked into one PackedLinear (the modules bound to views of it), or None
        (off or unsupported, reported)."""
        reason = self.off(fusion) or PackedLinear.unsupported(modules)
        if reason:
            self.skip(where, fusion, reason)
            return None
        packed, views = PackedLinear.concat(modules)
        for module, name, view in views:
            self.journal.set(module, name, view)
        return packed

    def projection(self, where, module):
        """`module` (o_proj, down_proj) on the backend's prefill path (its linear op) bound to its
        weights, or None: the stock module runs, unreported on a backend without a prefill path,
        else reported skipped (off, an adapter, unsupported)."""
        if self.backend == "reference" or getattr(ops.backend_module(self.backend), "linear", None) is None:
            return None
        reason = self.off("prefill") or ("LoRA adapter: stock" if adapter_of(module)[1] is not None
                                         else PackedLinear.unsupported([module]))
        if reason:
            self.skip(where, "prefill", reason)
            return None
        w, _ = PackedLinear.concat([module])   # one layer: its own arrays
        _, used, why = ops.select("linear", self.backend, **w.info())
        if used == "reference":
            self.skip(where, "prefill", why)
            return None
        return partial(self.select(where, "prefill", "linear", **w.info()), w=w)

    def configure(self, module, settings):
        for name, value in settings.items():
            self.journal.attr(module, name, value)

    def attention(self, where, attn):
        names = self.recipe["attention"]
        bases, adapters = zip(*(adapter_of(attn[names[r]]) for r in ("q", "k", "v")))
        lora = LORA_NOTE if any(a is not None for a in adapters) else ""
        ops_ = {}
        w = self.stack(where, "qkv", list(bases))
        if w is not None:
            ops_["qkv"] = self.select(where, "qkv", "qkv_proj", _notes(lora, shard_note(w, "o_proj")),
                                      **w.info())
        rope = RopeSpec.from_module(attn[names["rope"]])
        # From the weights, never hidden_size / n_heads (Qwen3-0.6B: 128, not 1024 / 16).
        head_dim = out_features(attn[names["q"]]) // attn.n_heads
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
        ops_["out"] = self.projection(f"{where}.{names['o']}", attn[names["o"]])
        self.configure(attn, attn.settings(ops_, qkv_weights=w, rope=rope,
                                           adapters=adapters if w is not None else (None,) * 3))

    def mlp(self, where, mlp):
        names = self.recipe["mlp"]
        bases, adapters = zip(*(adapter_of(mlp[names[r]]) for r in ("gate", "up")))
        w = self.stack(where, "gate_up", list(bases))
        fn = None
        if w is None:
            adapters = (None, None)
        elif any(a is not None for a in adapters):
            # SiLU must follow the deltas: the stacked projection as a plain linear op.
            # The head's op is a plain projection with the GEMV kernels for decode rows.
            fn = self.select(where, "gate_up", "lm_head", _notes(LORA_NOTE + ", then SiLU",
                                                                 shard_note(w, "down_proj")), **w.info())
        else:
            fn = self.select(where, "gate_up", "gate_up_silu", shard_note(w, "down_proj"), **w.info())
        down = self.projection(f"{where}.{names['down']}", mlp[names["down"]])
        self.configure(mlp, mlp.settings(fn, w, adapters, down))

    def block(self, where, block):
        names = self.recipe["block"]
        for role, setup in (("attention", self.attention), ("mlp", self.mlp)):
            child = block[names[role]]
            if type(child) in (FusedAttention, FusedMLP) and child.watch is block.watch:
                setup(f"{where}.{names[role]}", child)
        norm = block[names["post_norm"]]
        if type(norm) is not nn.RMSNorm:
            self.skip(where, "residual_norm", f"norm type {type(norm).__name__}")
            add_norm = None
        else:
            add_norm = self.select(where, "residual_norm", "rms_norm_residual",
                                   hidden=norm.weight.shape[0], dtype=norm.weight.dtype)
        self.configure(block, block.settings(add_norm))
        self.fast_block(where, block)

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
            self.journal.attr(fb, "fast_fn", fast)
            self.report.add(where, "fast_decode", "fused", self.backend)

    def head(self, text):
        """Swaps the head's class; returns (object, original class, head op), or None."""
        tied = "lm_head" not in text
        obj, where = (text.model.embed_tokens, "model.embed_tokens") if tied else (text.lm_head, "lm_head")
        reason = self.off("lm_head") or PackedLinear.unsupported([obj])
        if reason:
            self.skip(where, "lm_head", reason)
            return None
        w = PackedLinear.from_embedding(obj) if tied else PackedLinear.stack([obj])
        fn = self.select(where, "lm_head", "lm_head", **w.info())
        original, head = type(obj), _Head(fn, w)
        self.journal.cls(obj, head_class(original))
        self.journal.attr(obj, "_fastops_head_fn", head)
        return obj, original, head


def _plan(state, journal):
    """PatchState's plan: every fused block of `state`, then the head, set up from the model's
    current modules. Returns (report, head, the fusions switched off)."""
    report = PatchReport(state.recipe["family"], state.backend, tuning=state.tuning)
    p = Planner(state.recipe, state.backend, state.disabled, report, journal, state.tuning)
    for i, block in enumerate(decoder_layers(state.text)):
        if state.owns(block):
            p.block(f"layers.{i}", block)
    off = p.switched_off()
    if "prefill" in p.reasons:
        # The tuner judged `prefill` by prompt chunks; the decode path's steps of more rows (CUDA's
        # wide steps, qmm) replace the composed ops there, not stock's: its verdict leaves them on.
        off = off - {"prefill"}
    return report, p.head(state.text), off


class _Head:
    """The head op over its weights (a plain object: a copied model gets its own weights)."""

    def __init__(self, fn, w):
        self.fn, self.w = fn, w

    def __call__(self, x):
        return self.fn(x, self.w)


def patch(model, disable=(), tune=None):
    """Swap the model's modules for fused ones in place; returns a PatchReport.

    Patching an already patched model is a no-op that returns its report. `disable` takes
    fusion names (see mlx_fastops.config.FUSIONS; a list or a comma-separated string), added to
    MLX_FASTOPS_DISABLE. `tune` ("auto", "on", "off", "force", True/False or a Tuner; default
    MLX_FASTOPS_TUNE, else "auto": see mlx_fastops.tuner) times each fusion against stock on this
    device, or takes the cached decision, and leaves stock whatever does not win. If anything
    fails, the model is left exactly as it was.
    """
    state = model.__dict__.get(_STATE) if isinstance(model, nn.Module) else None
    if state is not None:
        return state.report
    recipe = _family(model)
    disabled = config.disabled(disable)
    backend = config.backend_name()
    how = tune if isinstance(tune, tuner.Tuner) else tuner.Tuner(config.tune_mode(tune))
    tuning = None
    if how.measures(backend):
        try:
            tuning = tuner.tune(text_model(model), recipe, backend, disabled, how,
                                lambda off: _apply(model, recipe, backend, off), lambda: unpatch(model))
        except BaseException as e:
            if hasattr(e, "add_note"):
                e.add_note("mlx_fastops.patch failed while tuning; the model is unpatched")
            raise
        disabled = disabled | tuning.off
    return _apply(model, recipe, backend, disabled, tuning).report


def _apply(model, recipe, backend, disabled, tuning=None):
    """Patch `model` with the fusions in `disabled` off (tuning: the decisions that switched some
    of them off, for the report); returns its PatchState. Atomic."""
    parked = model.__dict__.get(_PARKED)
    journal = Journal()
    try:
        journal.attr(model, _PARKED)
        if (parked is not None and (parked.backend, parked.disabled) == (backend, disabled) and parked.unchanged()
                and tuner.same_plan(parked.tuning, tuning)):
            # Re-patch after unpatch, the model untouched since: the same fused state again.
            parked.resume(journal)
            journal.attr(parked, "tuning", tuning)
            journal.attr(parked.report, "tuning", tuning)
            journal.attr(model, _STATE, parked)
            return parked
        text = text_model(model)
        state = PatchState(model, text, recipe, backend, disabled, _plan)
        state.tuning = tuning
        layers = decoder_layers(text)
        for i, block in enumerate(list(layers)):
            journal.set(layers, i, state.wrap(block))
        state.build(journal)
        journal.attr(model, _STATE, state)
        # Warm up the chosen kernels on this model's shapes, so the first real call does not compile.
        _warm_up(model, backend)
    except BaseException as e:
        journal.rollback()
        if hasattr(e, "add_note"):
            e.add_note("mlx_fastops.patch failed; the model is unchanged")
        raise
    return state


def _warm_up(model, backend):
    if backend == "reference":
        return
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    for n in (4, 1):
        mx.eval(model(mx.zeros((1, n), dtype=mx.int32), cache=cache))


def unpatch(model):
    """Restore the original module objects, holding the model's current children (modules
    replaced while patched, e.g. by nn.quantize, stay replaced); True if the model was patched.
    An up-to-date fused state is kept aside: patch() takes it back if nothing changed meanwhile."""
    state = model.__dict__.pop(_STATE, None)
    if state is None:
        return False
    if state.remove():
        object.__setattr__(model, _PARKED, state)
    return True


def is_patched(model):
    return _STATE in model.__dict__
