"""Weight containers shared by every backend."""

import sys
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

SUPPORTED_BITS = (4, 8)
SUPPORTED_GROUPS = (32, 64, 128)

# Linear layers whose rows can be stacked: mlx's own, and the column shards mlx-lm's
# `model.shard(group)` puts in for q/k/v and gate/up (mlx.nn.layers.distributed.shard_linear:
# each rank holds a slice of the rows and computes its slice of the output, x @ W_shard^T).
FLOAT_LINEAR = (nn.Linear, nn.AllToShardedLinear)
QUANTIZED_LINEAR = (nn.QuantizedLinear, nn.QuantizedAllToShardedLinear)
SHARDED_LINEAR = (nn.AllToShardedLinear, nn.QuantizedAllToShardedLinear)


def adapter_of(module):
    """(base layer, adapter): mlx-lm's LoRALinear (mlx_lm.tuner.lora, what `linear_to_lora_layers`
    and `mlx_lm.load(..., adapter_path=...)` put in) is its wrapped layer plus a low-rank term
    the fused modules add after the fused projection; anything else is its own base, no adapter.
    Only that exact class: DoRA and other wrappers compute something else and stay stock. (No
    LoRALinear exists unless its module was imported, so it is looked up, never imported.)"""
    lora = getattr(sys.modules.get("mlx_lm.tuner.lora"), "LoRALinear", None)
    if lora is not None and type(module) is lora:
        return module["linear"], module
    return module, None


def out_features(module):
    """Output size of a linear layer, or of the layer an adapter wraps (`.linear`)."""
    while "weight" not in module and isinstance(module.get("linear"), nn.Module):
        module = module["linear"]
    return module["weight"].shape[0]


@dataclass(frozen=True)
class PackedLinear:
    """One or more linear layers stacked along the output dimension.

    weight  [N, K] float, or [N, K*bits/32] uint32 (MLX affine packing) when `bits` is set
    scales, biases  [N, K/group_size] (quantised only); bias [N] or None
    splits  output sizes of the stacked layers (sum == N)
    group   the mx.distributed group whose ranks each hold such a slice of the rows (column
            shards of a tensor-parallel model), or None
    """

    weight: mx.array
    scales: mx.array | None
    biases: mx.array | None
    bias: mx.array | None
    splits: tuple
    in_features: int
    bits: int | None = None
    group_size: int | None = None
    group: object = None

    @property
    def quantized(self):
        return self.bits is not None

    @property
    def out_features(self):
        return sum(self.splits)

    def info(self):
        """The static shape class a backend decides support on."""
        return {"in_features": self.in_features, "splits": self.splits, "bits": self.bits,
                "group_size": self.group_size, "dtype": (self.scales if self.quantized else self.weight).dtype,
                "bias": self.bias is not None}

    @staticmethod
    def unsupported(modules):
        """Why these linear modules cannot be stacked and run by our ops, or None."""
        kinds = {type(m) for m in modules}
        if len(kinds) != 1:
            return f"mixed layer types {sorted(k.__name__ for k in kinds)}"
        m0 = modules[0]
        if isinstance(m0, SHARDED_LINEAR) and len({id(m.group) for m in modules}) != 1:
            return "column shards of different mx.distributed group objects"
        if isinstance(m0, (*QUANTIZED_LINEAR, nn.QuantizedEmbedding)):
            modes = {getattr(m, "mode", "affine") for m in modules}
            if modes != {"affine"}:
                return f"quantisation mode {sorted(modes)} (only affine is fused)"
            q = {(m.bits, m.group_size) for m in modules}
            if len(q) != 1:
                return f"mixed bits/group sizes {sorted(q)}"
            bits, group = q.pop()
            if bits not in SUPPORTED_BITS or group not in SUPPORTED_GROUPS:
                return f"bits={bits}, group_size={group} (fused: bits {SUPPORTED_BITS}, groups {SUPPORTED_GROUPS})"
        elif type(m0) not in (*FLOAT_LINEAR, nn.Embedding):
            return f"layer type {type(m0).__name__}"
        if len({"bias" in m for m in modules}) != 1:
            return "some layers have a bias and some do not"
        if len({m.weight.shape[1] for m in modules}) != 1:
            return "layers disagree on the input size"
        return None

    @classmethod
    def stack(cls, modules):
        """Concatenate the layers' arrays; the stock modules are rebound to views of the result.

        The views keep the stock modules working (for unpatch and for paths we leave stock) while
        the weights are stored once.
        """
        packed, views = cls.concat(modules)
        for m, name, view in views:
            m[name] = view
        return packed

    @classmethod
    def concat(cls, modules):
        """stack() without touching the modules: (PackedLinear, [(module, name, view)]), the views
        to bind (the patcher binds them through its journal). One layer is its own PackedLinear."""
        m0 = modules[0]
        quantized = isinstance(m0, QUANTIZED_LINEAR)
        names = ["weight"] + (["scales", "biases"] if quantized else []) + (["bias"] if "bias" in m0 else [])
        splits = tuple(m.weight.shape[0] for m in modules)
        views = []
        if len(modules) == 1:
            cat = {n: m0[n] for n in names}
        else:
            cat = {n: mx.concatenate([m[n] for m in modules], axis=0) for n in names}
            mx.eval(list(cat.values()))
            start = 0
            for m, size in zip(modules, splits):
                views += [(m, n, cat[n][start : start + size]) for n in names]
                start += size
        group = m0.group if isinstance(m0, SHARDED_LINEAR) else None
        if quantized:
            in_features = m0.weight.shape[1] * 32 // m0.bits
            packed = cls(cat["weight"], cat["scales"], cat["biases"], cat.get("bias"), splits,
                         in_features, m0.bits, m0.group_size, group)
        else:
            packed = cls(cat["weight"], None, None, cat.get("bias"), splits, m0.weight.shape[1],
                         group=group)
        return packed, views

    @classmethod
    def from_embedding(cls, emb):
        """The tied lm_head: an (optionally quantised) embedding used as a linear layer."""
        if isinstance(emb, nn.QuantizedEmbedding):
            if getattr(emb, "mode", "affine") != "affine":
                raise ValueError(f"embedding quantisation mode {emb.mode} is not fused")
            in_features = emb.weight.shape[1] * 32 // emb.bits
            return cls(emb.weight, emb.scales, emb.biases, None, (emb.weight.shape[0],),
                       in_features, emb.bits, emb.group_size)
        return cls(emb.weight, None, None, None, (emb.weight.shape[0],), emb.weight.shape[1])


@dataclass(frozen=True)
class RopeSpec:
    """Arguments of mx.fast.rope: rotate the first `dims` features; `freqs` overrides `base`."""

    dims: int
    traditional: bool
    base: float | None
    scale: float
    freqs: mx.array | None = None

    @classmethod
    def from_module(cls, rope):
        """RopeSpec for nn.RoPE and mlx-lm's Llama3RoPE; None for other variants."""
        if type(rope) is nn.RoPE:
            return cls(rope.dims, rope.traditional, rope.base, rope.scale)
        if type(rope).__name__ == "Llama3RoPE" and hasattr(rope, "_freqs"):
            return cls(rope.dims, rope.traditional, None, 1.0, rope._freqs)
        return None
