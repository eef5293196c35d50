"""One patch's state: what patch() changed on a model, how it is rebuilt when the model changes,
and how it is undone (unpatch, or a failure part-way through patch or a rebuild).

Every change goes through a Journal (each change with its undo). What the fused state was built
from is recorded as a snapshot: the identity of every item (array, child module, list entry) of
every module under the text model's decoder stack and its lm_head. Those modules' classes are
swapped for watched ones (modules.watched_class) whose item writes tell the Watch; the Watch's
next fused call then compares the model with the snapshot (identity only) and rebuilds the fused
state from the current modules where anything differs.
"""

import operator

import mlx.core as mx

from . import ops
from .modules import FusedAttention, FusedBlock, FusedMLP, Watch, _Fused, head_class, is_watched, watched_class

_MISSING = object()


class Journal:
    """Changes to a model, each recorded with its undo; rollback() undoes them, newest first."""

    def __init__(self):
        self._undo = []

    def undo(self, fn):
        """Record the undo of a change already made."""
        self._undo.append(fn)

    def set(self, container, key, value):
        """container[key] = value: a list entry, or a module's item (no Watch is told)."""
        if isinstance(container, list):
            old = container[key]
            self.undo(lambda: list.__setitem__(container, key, old))
            list.__setitem__(container, key, value)
            return
        old = dict.get(container, key, _MISSING)
        self.undo(lambda: dict.pop(container, key, None) if old is _MISSING
                  else dict.__setitem__(container, key, old))
        dict.__setitem__(container, key, value)

    def attr(self, obj, name, value=_MISSING):
        """A plain (instance) attribute set, or deleted where value is left out."""
        d = obj.__dict__
        old = d.get(name, _MISSING)
        self.undo(lambda: d.pop(name, None) if old is _MISSING else d.__setitem__(name, old))
        if value is _MISSING:
            d.pop(name, None)
        else:
            d[name] = value

    def cls(self, obj, new):
        old = type(obj)
        self.undo(lambda: setattr(obj, "__class__", old))
        obj.__class__ = new

    def rollback(self):
        while self._undo:
            self._undo.pop()()


def decoder_layers(text):
    """The list that holds the decoder blocks. Not `model.layers`: for qwen2 that property returns
    a fresh slice (`pipeline_layers`), and assigning into it changes nothing."""
    return text.model.layers


def _same(a, b):
    return len(a) == len(b) and all(map(operator.is_, a, b))


def _write_back(fused):
    """The stock module of a fused one, given the fused module's current children (what was
    replaced while patched stays replaced), plain attributes (mlx-lm's `model.shard` divides
    `n_heads`) and training mode."""
    stock = fused._stock
    for key in [k for k in vars(stock) if not k.startswith("_") and k in vars(fused)]:
        object.__setattr__(stock, key, vars(fused)[key])
    for key in [k for k in stock if k not in fused]:
        dict.__delitem__(stock, key)
    for key, value in fused.items():
        if isinstance(value, _Fused) and value.watch is fused.watch:
            value = _write_back(value)
        if dict.get(stock, key) is not value:
            dict.__setitem__(stock, key, value)
    object.__setattr__(stock, "_training", fused._training)
    return stock


class PatchState:
    """`plan(state, journal) -> (report, head, switched off)` (the patcher's) sets every fused
    module up from its current children; the rest is here: wrapping, watching, the backend's
    decode path (DecodePath.install), rebuilding and removal."""

    def __init__(self, model, text, recipe, backend, disabled, plan):
        self.model, self.text, self.recipe = model, text, recipe
        self.backend, self.disabled, self.plan = backend, disabled, plan
        self.watch = Watch(self.refresh)
        self.report = None
        self.tuning = None     # the tuner's decisions this patch was made with (tuner.Tuning), or None
        self.head = None       # (head object, its class before patch, its op), or None
        self.parked = None     # after remove(): the unpatched model's snapshot and the blocks' places
        self.decode = None     # what DecodePath.install returned, or None
        self.watched = []      # [(module, class before)]; None: its class already reports writes
        self.snapshot = []

    def owns(self, module):
        return isinstance(module, _Fused) and module.watch is self.watch

    def wrap(self, block):
        """A FusedBlock over a stock decoder block, its attention and MLP wrapped too."""
        names = self.recipe["block"]
        fb = FusedBlock(block, names, self.watch)
        dict.__setitem__(fb, names["attention"],
                         FusedAttention(block[names["attention"]], self.recipe["attention"], self.watch))
        dict.__setitem__(fb, names["mlp"], FusedMLP(block[names["mlp"]], self.recipe["mlp"], self.watch))
        return fb

    def _modules(self):
        mods = self.text.model.modules()
        return mods + [self.text["lm_head"]] if "lm_head" in self.text else mods

    def _objects(self):
        """Every item of every module the state depends on, and the entries of list items (the
        decoder layers): the snapshot compared by identity."""
        out = []
        for m in self._modules():
            for v in m.values():
                out.append(v)
                if isinstance(v, (list, tuple)):
                    out.extend(v)
        return out

    def build(self, journal):
        report, head, switched_off = self.plan(self, journal)
        journal.attr(self, "report", report)
        journal.attr(self, "head", head)
        self._watch_modules(journal)
        journal.attr(self, "decode", self._install(journal, switched_off, report))
        mx.eval(self.text.parameters())   # the stacked weights' views
        journal.attr(self, "snapshot", self._objects())

    def _watch_modules(self, journal):
        watched = []
        for m in self._modules():
            if not len(m) or self.owns(m):
                continue   # holds nothing (RoPE, Dropout), or reports writes itself
            if self.head is not None and m is self.head[0]:   # its head class reports writes
                journal.attr(m, "_fastops_watch", self.watch)
                watched.append((m, None))
            elif not is_watched(type(m)):
                watched.append((m, type(m)))
                journal.cls(m, watched_class(type(m)))
                journal.attr(m, "_fastops_watch", self.watch)
        journal.attr(self, "watched", watched)

    def _install(self, journal, switched_off, report):
        """The backend's whole-model decode path (DecodePath.install), once its blocks are fused."""
        path = ops.backend_module(self.backend).DECODE_PATH
        fasts = [b.fast_fn if self.owns(b) else None for b in decoder_layers(self.text)]
        if path is None or not any(fasts):
            return None
        installed, rows = path.install(self.model, fasts, switched_off)
        if installed is not None:
            journal.undo(installed.remove)
        for fusion, status, note in rows:
            report.add("model", fusion, status, self.backend if status == "fused" else "", note)
        return installed

    def _uninstall(self, journal):
        if self.decode is not None:
            self.decode.remove()
            journal.undo(self.decode.restore)
        for m, cls in reversed(self.watched):
            if cls is not None:
                journal.cls(m, cls)
            journal.attr(m, "_fastops_watch")
        if self.head is not None:
            obj, original, _ = self.head
            journal.cls(obj, original)
            journal.attr(obj, "_fastops_head_fn")

    def refresh(self, force=False):
        """Rebuild the fused state from the model's current modules if anything it was built
        from changed (force: in any case). On failure the state stays as it was and the error
        propagates (the fused call that asked then fails with it)."""
        if not force and _same(self.snapshot, self._objects()):
            return
        journal = Journal()
        try:
            self._uninstall(journal)
            self.build(journal)
        except BaseException:
            journal.rollback()
            raise

    def remove(self):
        """Undo the patch: every class swap, the decode path, and the stock blocks back in place.
        Returns whether the fused state was up to date (then resume() may take it back)."""
        self._uninstall(Journal())
        layers = decoder_layers(self.text)
        places = []
        for i, block in enumerate(layers):
            if self.owns(block):
                places.append((i, block))
                layers[i] = _write_back(block)
        current = not self.watch.stale
        self.parked = (self._objects(), places) if current else None
        return current

    def unchanged(self):
        """Whether the unpatched model still holds exactly what remove() left (by identity)."""
        return self.parked is not None and _same(self.parked[0], self._objects())

    def resume(self, journal):
        """Patch again with the state remove() took off (the model unchanged since)."""
        layers = decoder_layers(self.text)
        for i, block in self.parked[1]:
            journal.set(layers, i, block)
            for m in block.modules():
                if self.owns(m):
                    journal.attr(m, "_training", m._stock._training)
        if self.head is not None:
            obj, original, fn = self.head
            journal.cls(obj, head_class(original))
            journal.attr(obj, "_fastops_head_fn", fn)
        self._watch_modules(journal)
        if self.decode is not None:
            self.decode.restore()
            journal.undo(self.decode.remove)
        journal.attr(self, "snapshot", self._objects())
        journal.attr(self, "parked", None)
        for name, value in (("fast", True), ("training", False)):
            journal.attr(self.watch, name, value)
