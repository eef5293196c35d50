"""cuda_emu: run mlx_fastops' `mx.fast.cuda_kernel` kernel bodies on the CPU (no GPU, no CUDA toolkit).

    import cuda_emu
    k = cuda_emu.cuda_kernel(name=..., input_names=..., output_names=..., source=...,
                             ensure_row_contiguous=...)
    outs = k(inputs=[...], output_shapes=[...], output_dtypes=[...], grid=..., threadgroup=...)

Same interface as mx.fast.cuda_kernel (grid in threads). The body is compiled as C++17 by g++ against
cuda_compat.h, with the signature MLX would give it (`const T* name`, `name_shape` / `name_strides`
when the body uses them, then `T* out`), and its threads run as fibers, WINDOW blocks at a time, interleaved (see the header).
Inputs are passed in place (zero-copy views of the MLX arrays, strided ones too when
ensure_row_contiguous=False), so writes through a const_cast reach the array, as on the GPU.
Outputs start poisoned (NaN, or 0x7F7F7F7F for integers) unless init_value is given.

What it checks: the arithmetic, indexing and synchronisation logic of a kernel (barriers, masked
warp shuffles, blocks waiting for other blocks: resident blocks interleave and drift apart). What
it cannot: timing, memory-model effects (writes are visible at once), out-of-bounds reads (no guard
pages), the alignment of vector loads (MLX's CPU arrays are 8-byte aligned, a GPU's far more, so
a check here would refuse correct kernels), registers. See docs/cuda-emulator.md.
Results are "CUDA-emulator-verified"; the kernels still need `pytest -m cuda` on a GPU.
"""

import ctypes
import hashlib
import os
import re
import subprocess
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

HERE = Path(__file__).resolve().parent
CACHE = Path(os.environ.get("CUDA_EMU_CACHE", Path(tempfile.gettempdir()) / "cuda_emu_cache"))

_CTYPES = {mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.float32: "float",
           mx.int32: "int32_t", mx.uint32: "uint32_t", mx.int64: "int64_t", mx.uint8: "uint8_t"}
_NP = {mx.float16: np.float16, mx.bfloat16: np.uint16, mx.float32: np.float32, mx.int32: np.int32,
       mx.uint32: np.uint32, mx.int64: np.int64, mx.uint8: np.uint8}

PRE = """#include "cuda_compat.h"
namespace mlx::core::cu {   // where MLX's preamble defines them
struct Shape { int32_t d[10]; int32_t operator[](int i) const { return d[i]; } };
struct Strides { int64_t d[10]; int64_t operator[](int i) const { return d[i]; } };
}
using namespace mlx::core::cu;
"""


# `__shared__ TYPE NAME[..][..];` -> a reference into the block's arena (ids from 1);
# `extern __shared__ TYPE NAME[];` -> a pointer to the block's dynamic shared memory (id 0, the
# kernel's shared_memory bytes; every such declaration names the same bytes, as in CUDA)
_SHARED = re.compile(r"__shared__\s+([\w:]+)\s+(\w+)((?:\s*\[[^\]]*\])*)\s*;")
_DYNAMIC = re.compile(r"extern\s+__shared__\s+([\w:]+)\s+(\w+)\s*\[\s*\]\s*;")


def _shared_to_arena(code, dynamic_bytes=0):
    code = _DYNAMIC.sub(lambda m: f"{m[1]}* {m[2]} = reinterpret_cast<{m[1]}*>(::cuemu::shared_slot(0, "
                                  f"{int(dynamic_bytes)}));", code)
    ids = iter(range(1, 1 << 30))

    def sub(m):
        typ, name, dims = m[1], m[2], m[3].replace(" ", "")
        i = next(ids)
        if not dims:
            return f"{typ}& {name} = *reinterpret_cast<{typ}*>(::cuemu::shared_slot({i}, sizeof({typ})));"
        return (f"{typ} (&{name}){dims} = *reinterpret_cast<{typ}(*){dims}>("
                f"::cuemu::shared_slot({i}, sizeof({typ}{dims})));")
    return _SHARED.sub(sub, code)


# Blocks resident at once (their threads interleave); CUDA_EMU_WINDOW overrides.
WINDOW = int(os.environ.get("CUDA_EMU_WINDOW", "4"))


class KernelError(RuntimeError):
    pass


def _compile(code):
    CACHE.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha1(code.encode() + b"".join(h.read_bytes() for h in sorted(HERE.glob("*.h")))).hexdigest()[:16]
    so = CACHE / f"k_{key}.so"
    if not so.exists():
        src = CACHE / f"k_{key}.cpp"
        src.write_text(code)
        tmp = CACHE / f"k_{key}.{os.getpid()}.so"
        r = subprocess.run(["g++", "-std=c++17", "-O1", "-shared", "-fPIC", "-w", "-I", str(HERE), "-o", str(tmp),
                            str(src)], capture_output=True, text=True)
        if r.returncode:
            raise KernelError("[cuda_emu:compile] " + r.stderr[-3000:])
        os.replace(tmp, so)
    lib = ctypes.CDLL(str(so))
    lib.cuemu_launch.restype = ctypes.c_int
    return lib


class EmuCudaKernel:
    def __init__(self, name, input_names, output_names, source, header="", ensure_row_contiguous=True,
                 atomic_outputs=False, shared_memory=0):
        self.name, self.inputs, self.outputs = name, list(input_names), list(output_names)
        self.source, self.header, self.contiguous = source, header, ensure_row_contiguous
        self.shared_memory = shared_memory
        self._libs = {}

    def _code(self, in_dtypes, out_dtypes):
        params, unpack = [], []
        i = 0
        for n, dt in zip(self.inputs, in_dtypes):
            params.append(f"const {_CTYPES[dt]}* {n}")
            unpack.append(f"(const {_CTYPES[dt]}*)a[{i}]")
            i += 1
            for suffix, typ in (("shape", "Shape"), ("strides", "Strides")):
                if re.search(rf"\b{n}_{suffix}\b", self.source):
                    params.append(f"{typ} {n}_{suffix}")
                    unpack.append(f"*(const {typ}*)a[{i}]")
                    i += 1
        for n, dt in zip(self.outputs, out_dtypes):
            params.append(f"{_CTYPES[dt]}* {n}")
            unpack.append(f"({_CTYPES[dt]}*)a[{i}]")
            i += 1
        code = _shared_to_arena(self.header + "\n@@BODY@@\n" + self.source, self.shared_memory)
        header, body = code.split("\n@@BODY@@\n")
        return (PRE + header + f"\nstatic void body({', '.join(params)}) {{\n{body}\n}}\n"
                f"extern \"C\" void entry(void** a) {{ body({', '.join(unpack)}); }}\n")

    def __call__(self, inputs, output_shapes, output_dtypes, grid, threadgroup, init_value=None,
                 verbose=False, stream=None, template=None):
        if template:
            raise KernelError("[cuda_emu:call] template arguments are not supported")
        if len(inputs) != len(self.inputs):
            raise KernelError(f"[cuda_emu:call] {len(inputs)} inputs for {self.inputs}")
        arrs = [mx.array(x) if not isinstance(x, mx.array) else x for x in inputs]
        if self.contiguous:
            arrs = [mx.contiguous(a) for a in arrs]
        mx.eval(arrs)
        views = [np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a, copy=False) for a in arrs]
        outs = []
        for shape, dt in zip(output_shapes, output_dtypes):
            o = np.empty(shape, dtype=_NP[dt])
            if init_value is not None:
                o[...] = np.array(init_value, dtype=np.float32).astype(_NP[dt]) if dt != mx.bfloat16 else \
                    (np.array(init_value, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
            elif dt in (mx.float16, mx.float32):
                o[...] = np.nan
            elif dt == mx.bfloat16:
                o[...] = 0x7fc0
            else:
                o.view(np.uint8)[...] = 0x7F
            outs.append(o)
        key = (tuple(a.dtype for a in arrs), tuple(output_dtypes))
        lib = self._libs.get(key)
        if lib is None:
            lib = self._libs[key] = _compile(self._code(*key))
        keep, ptrs = [], []
        for n, a, v in zip(self.inputs, arrs, views):
            ptrs.append(v.ctypes.data if v.size else 0)
            for suffix in ("shape", "strides"):
                if re.search(rf"\b{n}_{suffix}\b", self.source):
                    if suffix == "shape":
                        buf = (ctypes.c_int32 * 10)(*list(a.shape)[:10])
                    else:
                        buf = (ctypes.c_int64 * 10)(*[s // v.itemsize for s in v.strides][:10])
                    keep.append(buf)
                    ptrs.append(ctypes.addressof(buf))
        ptrs += [o.ctypes.data for o in outs]
        args = (ctypes.c_void_p * len(ptrs))(*ptrs)
        g = [int(x) for x in grid] + [1] * (3 - len(grid))
        t = [int(x) for x in threadgroup] + [1] * (3 - len(threadgroup))
        if any(gi % ti for gi, ti in zip(g, t)):
            raise KernelError(f"[cuda_emu:call] grid {g} is not a multiple of the block {t}")
        if t[0] * t[1] * t[2] > 1024:
            raise KernelError(f"[cuda_emu:call] block of {t[0] * t[1] * t[2]} threads (max 1024)")
        err = ctypes.create_string_buffer(1024)
        entry = ctypes.cast(lib.entry, ctypes.c_void_p)
        rc = lib.cuemu_launch(entry, args, g[0] // t[0], g[1] // t[1], g[2] // t[2], t[0], t[1], t[2], WINDOW,
                              err, 1024)
        if rc:
            raise KernelError(f"[cuda_emu:{self.name}] {err.value.decode()}")
        res = []
        for o, dt in zip(outs, output_dtypes):
            res.append(mx.array(o).view(mx.bfloat16) if dt == mx.bfloat16 else mx.array(o))
        return res


def cuda_kernel(name, input_names, output_names, source, header="", ensure_row_contiguous=True,
                atomic_outputs=False, shared_memory=0):
    """Same signature as mx.fast.cuda_kernel."""
    return EmuCudaKernel(name, input_names, output_names, source, header, ensure_row_contiguous,
                         shared_memory=shared_memory)
