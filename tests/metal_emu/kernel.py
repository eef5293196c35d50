"""`metal_emu.metal_kernel`: mx.fast.metal_kernel's interface, run on the CPU emulator."""

import ctypes
import os
import sys

import mlx.core as mx
import numpy as np

from . import build, source as msource
from .errors import (CallError, KernelError, OrderDependence, UninitializedThreadgroupRead, UnwrittenOutput,
                     from_runtime)


class Config:
    """Knobs, read from the environment at import, settable in code (metal_emu.config.schedules = ...).

    schedules: "default" runs each dispatch 3 times (forward; forward with other poison patterns and
        guard placement; threadgroups and lanes reversed); "all" adds shuffled threadgroup and lane
        orders; "min" runs once (no order-dependence or uninitialised-memory checks).
        METAL_EMU_SCHEDULES.
    strict: compile every new instantiation in the strict tier too (METAL_EMU_STRICT, default 1).
    strict_collectives: SIMD-group functions called after some lanes of the SIMD-group returned are an
        error (METAL_EMU_STRICT_COLLECTIVES, default 1).
    timeout: seconds per dispatch before a spin-wait/endless loop is reported (METAL_EMU_TIMEOUT).
    seed: seed of the shuffled schedules (METAL_EMU_SEED).
    """

    def __init__(self):
        self.schedules = os.environ.get("METAL_EMU_SCHEDULES", "default")
        self.strict = os.environ.get("METAL_EMU_STRICT", "1") != "0"
        self.strict_collectives = os.environ.get("METAL_EMU_STRICT_COLLECTIVES", "1") != "0"
        self.timeout = int(os.environ.get("METAL_EMU_TIMEOUT", "120"))
        self.seed = int(os.environ.get("METAL_EMU_SEED", "12345"))


config = Config()

_STORAGE = {
    mx.bool_: np.bool_, mx.uint8: np.uint8, mx.uint16: np.uint16, mx.uint32: np.uint32,
    mx.uint64: np.uint64, mx.int8: np.int8, mx.int16: np.int16, mx.int32: np.int32, mx.int64: np.int64,
    mx.float16: np.float16, mx.bfloat16: np.uint16, mx.float32: np.float32, mx.float64: np.float64,
    mx.complex64: np.complex64,
}

POISON_A = 0xFF  # NaN for floats, -1 for signed integers
POISON_B = 0x7F  # a huge finite float32, NaN for half, large positive integers


def _to_numpy(a):
    """NumPy view of an mx.array (bfloat16 as its uint16 bits), keeping its strides."""
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.array(a, copy=False)


def _from_numpy(n, dtype):
    a = mx.array(n)
    return a.view(mx.bfloat16) if dtype == mx.bfloat16 else a


def _as_array(x):
    if isinstance(x, mx.array):
        return x
    if isinstance(x, (bool, int, float, np.generic, np.ndarray)):
        return mx.array(x)
    raise CallError(f"inputs must be mx.array or Python scalars, got {type(x).__name__}")


def _host_input(a, ensure_row_contiguous):
    """(bytes as a uint8 array, element strides) as MLX would hand them to the kernel."""
    n = _to_numpy(a)
    itemsize = n.dtype.itemsize
    if n.ndim == 0:
        return np.frombuffer(np.ascontiguousarray(n).tobytes(), np.uint8).copy(), ()
    if ensure_row_contiguous or n.flags.c_contiguous or n.size == 0:
        c = np.ascontiguousarray(n)
        strides = tuple(s // itemsize for s in c.strides) if c.size else (0,) * c.ndim
        return np.frombuffer(c.tobytes(), np.uint8).copy(), strides
    if any(s < 0 for s in n.strides):
        raise CallError("negative strides are not emulated")
    span = sum((d - 1) * s for d, s in zip(n.shape, n.strides)) + itemsize
    raw = np.frombuffer(ctypes.string_at(n.ctypes.data, span), np.uint8).copy()
    return raw, tuple(s // itemsize for s in n.strides)


class _Launch:
    """Everything for one call, runnable under several schedules."""

    def __init__(self, kernel, lib, params, src, inputs, output_shapes, output_dtypes, grid, threadgroup,
                 init_value):
        self.k = kernel
        self.source = src
        self.lib = lib
        self.output_shapes = [tuple(int(d) for d in s) for s in output_shapes]
        self.output_dtypes = list(output_dtypes)
        self.init_value = init_value
        self.grid = [int(g) for g in grid]
        self.tg = [int(t) for t in threadgroup]
        tgc = [max(1, min(t, g)) for t, g in zip(self.tg, self.grid)]
        self.ngroups = [0 if g == 0 else -(-g // t) for g, t in zip(self.grid, tgc)]
        self.total_groups = int(np.prod(self.ngroups))
        in_names = kernel.input_names
        host_in = {}
        for nm, a in zip(in_names, inputs):
            data, strides = _host_input(a, kernel.ensure_row_contiguous)
            host_in[nm] = data
            host_in[nm + "_shape"] = np.array(a.shape, np.int32).view(np.uint8)
            host_in[nm + "_strides"] = np.array(strides, np.int64).view(np.uint8)
            host_in[nm + "_ndim"] = np.array([a.ndim], np.int32).view(np.uint8)
        self.slots = []  # (name, input bytes | output index)
        for kind, _typ, nm, idx in sorted((p for p in params if p[0] == "buffer"), key=lambda p: p[3]):
            if nm in kernel.output_names:
                self.slots.append((nm, kernel.output_names.index(nm)))
            else:
                self.slots.append((nm, host_in[nm]))
        self.names = (ctypes.c_char_p * len(self.slots))(*[s[0].encode() for s in self.slots])

    def _outputs(self, poison):
        outs = []
        for shape, dt in zip(self.output_shapes, self.output_dtypes):
            if self.init_value is not None:
                o = _to_numpy(mx.full(shape, self.init_value, dtype=dt)).copy()
            else:
                o = np.empty(shape, _STORAGE[dt])
                o.view(np.uint8).fill(poison)
            outs.append(o)
        return outs

    def run(self, group_mode="forward", lane_mode=0, tg_poison=POISON_A, out_poison=POISON_A, guard=0, seed=1):
        outs = self._outputs(out_poison)
        bufs = []
        for nm, s in self.slots:
            bufs.append(outs[s].reshape(-1).view(np.uint8) if isinstance(s, int) else s)
        n = len(bufs)
        ptrs = (ctypes.c_void_p * n)(*[b.ctypes.data for b in bufs])
        sizes = (ctypes.c_ulonglong * n)(*[b.nbytes for b in bufs])
        is_out = (ctypes.c_int * n)(*[isinstance(s, int) for _, s in self.slots])
        order = np.arange(self.total_groups, dtype=np.int64)
        if group_mode == "reverse":
            order = order[::-1].copy()
        elif group_mode == "shuffle":
            np.random.default_rng(seed).shuffle(order)
        err = ctypes.create_string_buffer(4096)
        rc = self.lib.mtl_emu_launch(
            ctypes.c_int(n), ptrs, sizes, self.names, is_out, (ctypes.c_uint * 3)(*self.grid),
            (ctypes.c_uint * 3)(*self.tg), order.ctypes.data_as(ctypes.POINTER(ctypes.c_longlong)),
            ctypes.c_longlong(self.total_groups), ctypes.c_int(lane_mode), ctypes.c_ulonglong(seed),
            ctypes.c_int(tg_poison), ctypes.c_int(guard), ctypes.c_int(int(config.strict_collectives)),
            ctypes.c_int(config.timeout), err, ctypes.c_int(len(err)))
        if rc != 0:
            raise from_runtime(err.value.decode(errors="replace"), self.k.name, self.source)
        return outs


def _differences(a_outs, b_outs, names, dtypes, tolerant):
    """[(output name, indices of differing elements, values a, values b)]"""
    res = []
    for nm, dt, a, b in zip(names, dtypes, a_outs, b_outs):
        if tolerant and dt in (mx.float16, mx.float32, mx.bfloat16):
            fa = np.array(_from_numpy(a, dt).astype(mx.float32))
            fb = np.array(_from_numpy(b, dt).astype(mx.float32))
            bad = ~np.isclose(fa, fb, rtol=1e-3, atol=1e-5, equal_nan=True)
        else:
            bad = a.view(np.uint8).reshape(a.shape + (-1,)) != b.view(np.uint8).reshape(b.shape + (-1,))
            bad = bad.any(axis=-1)
        if bad.any():
            res.append((nm, np.argwhere(bad), a, b))
    return res


def _describe(diffs, dtypes_by_name):
    parts = []
    for nm, idx, a, b in diffs:
        first = tuple(int(i) for i in idx[0])
        dt = dtypes_by_name[nm]
        va = np.array(_from_numpy(a[first], dt).astype(mx.float32)) if a.ndim else a
        vb = np.array(_from_numpy(b[first], dt).astype(mx.float32)) if b.ndim else b
        parts.append(f"output '{nm}': {len(idx)} of {a.size} elements differ, first at index {first} "
                     f"({va} vs {vb})")
    return "; ".join(parts)


class EmuKernel:
    def __init__(self, name, input_names, output_names, source, header="", ensure_row_contiguous=True,
                 atomic_outputs=False, compile_options=None):
        if not output_names:
            raise CallError("[metal_kernel] Must specify at least one output.")
        self.name = name
        self.input_names = list(input_names)
        self.output_names = list(output_names)
        self.source = source
        self.header = header
        self.ensure_row_contiguous = bool(ensure_row_contiguous)
        self.atomic_outputs = bool(atomic_outputs)
        self.compile_options = compile_options
        self._sources = {}
        self.instantiations = []  # the MLX sources this kernel object was called with

    @property
    def spec(self):
        return dict(name=self.name, input_names=self.input_names, output_names=self.output_names,
                    source=self.source, header=self.header, ensure_row_contiguous=self.ensure_row_contiguous,
                    atomic_outputs=self.atomic_outputs, compile_options=self.compile_options)

    def mlx_source(self, inputs, output_shapes, output_dtypes, grid, threadgroup, template, init_value):
        key = (tuple((a.dtype, a.ndim == 0, a.size < msource.MAX_CONSTANT_ARRAY_SIZE) for a in inputs),
               tuple(output_dtypes), repr(template))
        if key not in self._sources:
            _, src, _ = msource.mlx_source(self.spec, inputs, output_shapes, output_dtypes, grid, threadgroup,
                                           template, init_value)
            self._sources[key] = src
            self.instantiations.append(src)
        return self._sources[key]

    def __call__(self, *, inputs, output_shapes, output_dtypes, grid, threadgroup, template=None, init_value=None,
                 verbose=False, stream=None):
        from .strict import start_strict

        if len(inputs) != len(self.input_names):
            raise CallError(f"[metal_kernel] Expected `inputs` to have size {len(self.input_names)} but got size "
                            f"{len(inputs)}.", kernel=self.name)
        if len(output_shapes) != len(self.output_names) or len(output_dtypes) != len(self.output_names):
            raise CallError(f"[metal_kernel] Expected `output_shapes` and `output_dtypes` to have size "
                            f"{len(self.output_names)}.", kernel=self.name)
        if len(grid) != 3 or len(threadgroup) != 3:
            raise CallError("grid and threadgroup must have 3 entries", kernel=self.name)
        if any(int(t) < 1 for t in threadgroup) or any(int(g) < 0 for g in grid):
            raise CallError(f"invalid grid {tuple(grid)} / threadgroup {tuple(threadgroup)}", kernel=self.name)
        for _, v in template or []:
            if not isinstance(v, (bool, int, mx.Dtype)):
                raise CallError("template argument values must be Dtype, int or bool", kernel=self.name)
        inputs = [_as_array(x) for x in inputs]
        for d in [a.dtype for a in inputs] + list(output_dtypes):
            if d == mx.float64:
                raise CallError("float64 arrays cannot be passed to Metal kernels (Metal has no double)",
                                kernel=self.name)
        mx.eval(inputs)
        src = self.mlx_source(inputs, output_shapes, output_dtypes, grid, threadgroup, template, init_value)
        if verbose:
            print(f"Generated source code for `{self.name}`:\n```\n{src}\n```", file=sys.stdout)
        pending = start_strict(src, self.header, self.source, kernel=self.name) if config.strict else None
        try:
            lib, params = build.build(src, self.name)
        except KernelError:
            if pending is not None:
                pending.wait()  # the strict tier's diagnosis first, if it has one
            raise
        if pending is not None:
            pending.wait()
        launch = _Launch(self, lib, params, src, inputs, output_shapes, output_dtypes, grid, threadgroup, init_value)
        a = launch.run()
        if config.schedules != "min":
            self._check_schedules(launch, a)
        return [_from_numpy(o, dt) for o, dt in zip(a, output_dtypes)]

    def _check_schedules(self, launch, a):
        names, dtypes = self.output_names, launch.output_dtypes
        by_name = dict(zip(names, dtypes))
        tolerant = self.atomic_outputs
        # other poison patterns (threadgroup memory, outputs) and the buffers against the lower guard page
        b = launch.run(tg_poison=POISON_B, out_poison=POISON_B, guard=1)
        diffs = _differences(a, b, names, dtypes, False)
        if diffs:
            c = launch.run(tg_poison=POISON_B, out_poison=POISON_A)
            tg_diffs = _differences(a, c, names, dtypes, False)
            if tg_diffs:
                raise UninitializedThreadgroupRead(
                    "the output depends on threadgroup memory no lane wrote, or on a SIMD-group shuffle/broadcast "
                    "from an inactive lane (results change with the poison pattern; a missing barrier, a read "
                    f"past what was stored, or a shuffle beyond a partial SIMD-group): "
                    f"{_describe(tg_diffs, by_name)}", kernel=self.name)
            raise UnwrittenOutput(
                "output elements no lane wrote (MLX leaves outputs uninitialised unless init_value is given): "
                f"{_describe(diffs, by_name)}", kernel=self.name)
        schedules = [dict(group_mode="reverse", lane_mode=1)]
        if config.schedules == "all":
            schedules += [dict(group_mode="shuffle", lane_mode=2, seed=config.seed),
                          dict(group_mode="forward", lane_mode=2, seed=config.seed + 1),
                          dict(group_mode="shuffle", lane_mode=0, seed=config.seed + 2)]
        for sch in schedules:
            r = launch.run(**sch)
            diffs = _differences(a, r, names, dtypes, tolerant)
            if diffs:
                raise OrderDependence(
                    f"the output depends on the order threads run in (forward vs threadgroups {sch['group_mode']}, "
                    f"lanes {['forward', 'reversed', 'shuffled'][sch['lane_mode']]}): a missing "
                    f"threadgroup_barrier, a race on device or threadgroup memory, or a dependence between "
                    f"threadgroups: {_describe(diffs, by_name)}", kernel=self.name)


def metal_kernel(name, input_names, output_names, source, header="", ensure_row_contiguous=True,
                 atomic_outputs=False, compile_options=None):
    """Same signature as mx.fast.metal_kernel; the returned callable runs on the CPU emulator."""
    return EmuKernel(name, input_names, output_names, source, header, ensure_row_contiguous, atomic_outputs,
                     compile_options)
