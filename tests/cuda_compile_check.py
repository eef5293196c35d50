"""Offline syntax/resource check of the CUDA kernel bodies (no GPU needed).

Wraps each body the way mx.fast.cuda_kernel does (mlx-kernel-api.md section 4.1), compiles it to
PTX with NVRTC (what MLX uses) and assembles it with `ptxas -arch=sm_90a -v` for registers and
spills. Usage: python3 tests/cuda_compile_check.py [filter]

NVRTC and ptxas come from a CUDA install or from the PyPI wheels nvidia-cuda-nvrtc-cu12,
nvidia-cuda-nvcc-cu12 (ptxas) and nvidia-cuda-runtime-cu12 (headers), or their CUDA 13 forms
nvidia-cuda-nvrtc, nvidia-cuda-runtime and nvidia-cuda-cccl (nvidia/cu13/...), unpacked anywhere:
set CUDA_WHEELS=<dir holding nvidia/> (default: a CUDA install under /usr/local/cuda). NVRTC must
not be newer than the ptxas (a CUDA 13.0 ptxas refuses 13.5's PTX: take nvidia-cuda-nvrtc==13.0.*).
"""

import ctypes
import functools
import glob
import os
import re
import subprocess
import sys
import tempfile
import time

import mlx.core as mx

# the checkout this file is in, not an installed mlx_fastops (an editable install of another one)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mlx_fastops.backends.cuda import attention as A
from mlx_fastops.backends.cuda import gemv as G
from mlx_fastops.backends.cuda import head as HD
from mlx_fastops.backends.cuda import layer
from mlx_fastops.backends.cuda import qmm as QM
from mlx_fastops.backends.cuda import step
from mlx_fastops.backends.cuda import quantized_kv as QKV
from mlx_fastops.backends.cuda.source import CTYPE, source

PRE = r"""
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cooperative_groups.h>
#include <cuda/std/cstdint>
#define INFINITY __int_as_float(0x7f800000)  // MLX's preamble brings math.h's
using cuda::std::uint32_t; using cuda::std::int32_t; using cuda::std::int64_t;
namespace mlx::core::cu {   // MLX's device/utils.cuh: cuda::std::array<int32_t / int64_t, 10>
struct Shape { int32_t d[10]; __device__ int32_t operator[](int i) const { return d[i]; } };
struct Strides { int64_t d[10]; __device__ int64_t operator[](int i) const { return d[i]; } };
}
"""


def wrap(name, src, inputs, outputs, header=""):
    params = []
    for n, t in inputs:
        params.append(f"const {t}* {n}")
        if f"{n}_shape" in src:
            params.append(f"const __grid_constant__ Shape {n}_shape")
        if f"{n}_strides" in src:
            params.append(f"const __grid_constant__ Strides {n}_strides")
    for n, t in outputs:
        params.append(f"{t}* {n}")
    # as MLX builds it: header, then the kernel inside namespace mlx::core::cu
    return (PRE + header + "namespace mlx::core::cu {\nnamespace cg = cooperative_groups;\n"
            f"__global__ void {name}(" + ", ".join(params) + ") {\n" + src + "\n}\n}\n")


def _find(patterns):
    roots = [os.environ.get("CUDA_WHEELS", ""), "/usr/local/cuda"]
    for r in roots:
        for pat in patterns:
            hits = sorted(glob.glob(os.path.join(r, pat)))
            if r and hits:
                return hits[0]
    raise SystemExit(f"not found: {patterns} under {roots} (set CUDA_WHEELS)")


@functools.lru_cache(maxsize=None)
def _nvrtc():
    """(NVRTC library, CUDA include dir, CCCL include dir), found and loaded once for every case."""
    path = _find(["nvidia/cuda_nvrtc/lib/libnvrtc.so*", "nvidia/cu13/lib/libnvrtc.so*", "lib64/libnvrtc.so*"])
    for builtins in glob.glob(os.path.join(os.path.dirname(path), "libnvrtc-builtins.so*")):
        ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)   # NVRTC opens it by name: a wheel's is not on the search path
    lib = ctypes.CDLL(path)
    inc = os.path.dirname(_find(["nvidia/cuda_runtime/include/cuda_bf16.h", "nvidia/cu13/include/cuda_bf16.h",
                                 "include/cuda_bf16.h"]))
    cccl = os.path.dirname(os.path.dirname(_find(["nvidia/cuda_cccl/include/nv/target", "nvidia/cu13/include/cccl/nv/target",
                                                  "include/nv/target"])))
    return lib, inc, cccl


def nvrtc_ptx(src, name):
    lib, inc, cccl = _nvrtc()
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), name.encode(), 0, None, None) == 0
    opts = [b"--gpu-architecture=compute_90a", b"-std=c++17", b"-default-device", f"-I{inc}".encode(),
            f"-I{cccl}".encode()]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    if rc:
        return None, log.value.decode(errors="replace")
    lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetPTX(prog, ptx)
    return ptx.value.decode(), log.value.decode(errors="replace")


def gemv_case(dtype, M, K, N, bits, gs, epi, norm, bias, res, head=None):
    T = CTYPE[dtype]
    vec, R, nw = G.gemv_config(M, K, N, bits, epi)
    d = G.gemv_defines(dtype, M, bits, gs, epi, vec, R, nw, 1e-6 if norm else None, bias, head,
                       G.x_stage(M, K, dtype, bits, vec))
    src = source("gemv.cu", d, dtype)
    types = {"x": T, "w": "uint32_t", "sc": T, "bi": T, "nw": T, "bias": T,
             "res": T, "qn": T, "kn": T, "off": "int32_t", "after": T,
             "rf": "float", "kc": T, "vc": T, "cnt": "int32_t"}
    ins = [(n, types[n]) for n in G.gemv_inputs(norm, bias, res, head)]
    outs = [("yq", T), ("ys", "float")] if epi == 3 else [("y", T)]
    return wrap(f"gemv_e{epi}_m{M}_b{bits}", src, ins, outs), nw * 32


def qmm_case(dtype, M, K, N, bits, epi, bias=False, head=None, norm=False):
    """qmm.cu; with a head description, EPI 3 (qmm_head: the QKV projection with the head epilogue);
    norm: EPI 1's normalised output."""
    T = CTYPE[dtype]
    MT, NW, _, _ = QM.qmm_config(M, K, N // 2 if epi == 2 else N, bits, epi)
    d = dict(BITS=bits, GS=64, MT=MT, NW=NW, EPI=epi, HAS_BIAS=bias, MMA_BF16=dtype == mx.bfloat16)
    ins = [("x", T), ("w", "uint32_t"), ("sc", T), ("bi", T)] + ([("bias", T)] if bias else [])
    ins += [("res", T)] if epi == 1 else []
    outs = [("y", T)]
    if head is not None:
        d.update(HD.head_defines(head))
        types = {"qn": T, "kn": T, "off": "int32_t", "lp": "int32_t", "rf": "float", "kc": T, "vc": T,
                 "after": T, "k_w": "uint32_t", "k_s": T, "k_b": T, "v_w": "uint32_t", "v_s": T, "v_b": T}
        ins += [(n, types[n]) for n in HD.head_inputs(head)] + [("cnt", "int32_t")]
        outs = [("ys", "float"), ("yq", T)]
    if norm:
        d["NORM_EPS"] = "1e-06f"
        ins += [("nw", T), ("cnt", "int32_t")]
        outs += [("yn", T)]
    return wrap(f"qmm_e{epi}_m{M}_b{bits}", source("qmm.cu", d, dtype), ins, outs), NW * 32


def attn_case(dtype, L, H, HKV, D):
    T = CTYPE[dtype]
    src = source("attention.cu", A.attn_defines(L, H, HKV, D, 0.0883883), dtype)
    ins = [("q", T), ("kc", T), ("vc", T), ("off", "int32_t"), ("cnt", "int32_t")]
    outs = [("o", T), ("pm", "float"), ("po", "float")]
    return wrap(f"attn_d{D}_g{H // HKV}", src, ins, outs), A.ATTN_WARPS * 32


def qattn_case(dtype, L, H, HKV, D, bits, gs, causal):
    T = CTYPE[dtype]
    defines = {**A.attn_defines(L, H, HKV, D, 0.0883883), "BITS": bits, "GS": gs, "CAUSAL": causal}
    src = source("quantized_attention.cu", defines, dtype)
    ins = [("q", T), ("k_w", "uint32_t"), ("k_s", T), ("k_b", T), ("v_w", "uint32_t"), ("v_s", T), ("v_b", T),
           ("cnt", "int32_t")]
    outs = [("o", T), ("pm", "float"), ("po", "float")]
    return wrap(f"qattn_d{D}_g{H // HKV}_b{bits}", src, ins, outs), A.ATTN_WARPS * 32


def layer_case(M, head, nsplit, shapes, bias=False, nlayers=1, stamps=False):
    """The one-launch decoder layer(s) (layer.layer_build), captured instead of built; large as a layer
    over block.GROUP_MAX_WEIGHTS would be."""
    from mlx_fastops import kernels
    from mlx_fastops.backends.cuda import block
    gb = A.head_subgroup(head["H"] // head["HKV"])
    large = sum(N * K for _, _, N, K in shapes) > block.GROUP_MAX_WEIGHTS
    with kernels.use_cuda_factory(lambda **kw: kw):
        kw, _, _ = layer.layer_build(mx.bfloat16, M, shapes, 1e-6, 1e-6, bias, tuple(sorted(head.items())), nsplit,
                                     0.088, gb, nlayers, stamps, large)
    T = CTYPE[mx.bfloat16]
    base = lambda n: n.rstrip("0123456789")   # layer j's inputs carry the suffix j
    typ = lambda n: "uint32_t" if base(n).endswith("_w") else (
        "int32_t" if n in ("off", "head_cnt", "attn_cnt", "ctr") or base(n) == "lp" else ("float" if base(n) == "rf" else T))
    ins = [(n, typ(n)) for n in kw["input_names"]]
    outs = [(n, "float" if n in ("ys", "pm", "po") else "int64_t" if n == "stamps" else T) for n in kw["output_names"]]
    # MLX's kernel name, which a register cap's macro in the header names (layer._layer_kernel). A
    # layer launched alone, and layers 3 or more to a launch (the cap's purpose), must keep
    # gemv.BLOCKS_PER_SM blocks per SM, which the GEMV blockings assume. Instrumented launches (stamps:
    # a layer's phase tables, not decode) may spill a few bytes under the cap (4 Llama-3.2-1B layers: 4 bytes)
    need = G.BLOCKS_PER_SM if nlayers != 2 else 1
    spill_ok = 16 if stamps else 0
    return wrap(f"custom_kernel_{kw['name']}", kw["source"], ins, outs, kw["header"]), 128, need, spill_ok


def cases():
    bf, f16 = mx.bfloat16, mx.float16
    q06 = dict(D=128, H=16, HKV=8, L=1, freqs=False, qknorm=True, trad=False, qeps=1e-6, keps=1e-6,
               log2_base=19.93, scale=1.0)
    shapes06 = ((4, 64, 4096, 1024), (4, 64, 1024, 2048), (4, 64, 6144, 1024), (4, 64, 1024, 3072))
    shapes4b = ((4, 64, 6144, 2560), (4, 64, 2560, 4096), (4, 64, 19456, 2560), (4, 64, 2560, 9728))
    shapes8b = ((4, 64, 6144, 4096), (4, 64, 4096, 4096), (4, 64, 24576, 4096), (4, 64, 4096, 12288))
    llama1b = {**q06, "D": 64, "H": 32, "L": 1, "qknorm": False, "freqs": True}
    shapes_l1b = ((4, 64, 3072, 2048), (4, 64, 2048, 2048), (4, 64, 16384, 2048), (4, 64, 2048, 8192))
    llama3b = {**q06, "H": 24, "qknorm": False, "freqs": True}   # GQA 3
    shapes_l3b = ((4, 64, 5120, 3072), (4, 64, 3072, 3072), (4, 64, 16384, 3072), (4, 64, 3072, 8192))
    q25 = {**q06, "D": 64, "H": 14, "HKV": 2, "qknorm": False}   # GQA 7: attention blocks of one head
    shapes25 = ((4, 64, 1152, 896), (4, 64, 896, 896), (4, 64, 9728, 896), (4, 64, 896, 4864))
    shapes14b = ((4, 64, 7168, 5120), (4, 64, 5120, 5120), (4, 64, 34816, 5120), (4, 64, 5120, 17408))
    shapes25_7b = ((4, 64, 4608, 3584), (4, 64, 3584, 3584), (4, 64, 37888, 3584), (4, 64, 3584, 18944))
    g8 = {**q06, "H": 64, "HKV": 8}     # GQA 8, D 128: the largest attention phase
    shapes_g8 = ((4, 64, 10240, 4096), (4, 64, 4096, 8192), (4, 64, 28672, 4096), (4, 64, 4096, 14336))
    # (name, M, head, attention splits, shapes, qkv bias, layers per launch, stamps)
    layers = [("qwen3-0.6b", 1, q06, 33, shapes06, False, 1, False), ("qwen3-0.6b", 2, q06, 33, shapes06, False, 1, False),
              ("qwen3-4b", 1, {**q06, "H": 32}, 33, shapes4b, False, 1, False),
              ("qwen3-4b", 1, {**q06, "H": 32}, 33, shapes4b, False, 1, True),
              ("qwen3-8b", 1, {**q06, "H": 32}, 17, shapes8b, False, 1, False),
              # batched decode rows: 8-16-byte lane loads up to 4 rows, x staged as T values where it fits
              ("qwen3-4b", 2, {**q06, "H": 32}, 17, shapes4b, False, 1, False),
              ("qwen3-4b", 4, {**q06, "H": 32}, 9, shapes4b, False, 1, False),
              ("qwen3-8b", 3, {**q06, "H": 32}, 11, shapes8b, False, 1, False),
              ("qwen3-8b", 8, {**q06, "H": 32}, 5, shapes8b, False, 1, False),
              # large layers sharing a launch (at one row: step.LARGE_SHARED_MAX_ROWS); like any launch of
              # 3 or more layers capped at 128 registers, also at 4 rows (a larger LARGE_SHARED_MAX_ROWS)
              ("qwen3-4b", 1, {**q06, "H": 32}, 33, shapes4b, False, 3, False),
              ("qwen3-4b", 1, {**q06, "H": 32}, 33, shapes4b, False, 36, False),
              ("qwen3-8b", 1, {**q06, "H": 32}, 33, shapes8b, False, 36, False),
              ("qwen3-4b", 4, {**q06, "H": 32}, 9, shapes4b, False, 3, False),
              # the most layers a launch takes (step.MAX_LAYERS_PER_LAUNCH) with the most parameters a
              # layer passes (a quantised batch cache): within NVRTC's 32 KB of kernel parameters
              ("qwen3-8b kv8 batch", 1, {**q06, "H": 32, "kv": (8, 64), "lpad": True}, 33, shapes8b, False,
               step.MAX_LAYERS_PER_LAUNCH, False),
              # 8-bit weights: every GEMV phase of a large layer on gemv.cu, none sending rows to L2 before its wait
              ("qwen3-8b b8", 1, {**q06, "H": 32}, 17, tuple((8, 64, N, K) for _, _, N, K in shapes8b), False, 1, False),
              ("qwen2.5-0.5b", 1, q25, 33, shapes25, True, 1, False),
              # odd G: one query head an attention block (attention.head_subgroup; G = 3, 5, 7)
              ("qwen3-14b", 1, {**q06, "H": 40}, 17, shapes14b, False, 1, False),
              ("qwen2.5-7b", 1, {**q25, "D": 128, "H": 28, "HKV": 4}, 17, shapes25_7b, True, 1, False),
              # a QKV bias on gemv_mma.cu's head epilogue (on gemv.cu at 8 rows: 207 registers)
              ("qwen2.5-7b batch", 8, {**q25, "D": 128, "H": 28, "HKV": 4, "lpad": True}, 2, shapes25_7b, True, 1, False),
              ("llama-3b batch", 2, {**llama3b, "lpad": True}, 11, shapes_l3b, False, 1, False),
              ("llama-3b batch", 8, {**llama3b, "lpad": True}, 2, shapes_l3b, False, 1, False),
              ("llama-1b", 1, llama1b, 33, shapes_l1b, False, 1, False),
              ("llama-1b", 1, llama1b, 33, shapes_l1b, False, 4, True),
              ("llama-1b", 1, llama1b, 33, shapes_l1b, False, 16, False),
              ("qwen3-0.6b", 2, q06, 33, shapes06, False, 2, False), ("qwen3-0.6b", 1, q06, 33, shapes06, False, 4, False),
              ("qwen3-0.6b", 1, q06, 33, shapes06, False, 28, False), ("qwen3-0.6b", 1, q06, 33, shapes06, False, 28, True),
              ("G8 D128", 8, g8, 4, shapes_g8, False, 1, False),
              # a batch cache's rows (LEFT_PAD: per-layer left padding)
              ("qwen3-0.6b batch", 4, {**q06, "lpad": True}, 33, shapes06, False, 1, False),
              ("qwen3-0.6b batch", 8, {**q06, "lpad": True}, 33, shapes06, False, 28, False),
              ("llama-1b batch", 8, {**llama1b, "lpad": True}, 5, shapes_l1b, False, 16, False),
              ("qwen2.5-0.5b batch", 3, {**q25, "lpad": True}, 33, shapes25, True, 1, False),
              ("qwen3-4b batch", 4, {**q06, "H": 32, "lpad": True}, 9, shapes4b, False, 1, False),
              # over a quantised cache (kv_bits): the QKV epilogue quantises, the attention phase reads packed
              ("qwen3-4b kv8", 1, {**q06, "H": 32, "kv": (8, 64)}, 17, shapes4b, False, 1, False),
              ("qwen3-8b kv4", 1, {**q06, "H": 32, "kv": (4, 64)}, 17, shapes8b, False, 1, False),
              ("qwen3-8b kv4", 4, {**q06, "H": 32, "kv": (4, 64)}, 9, shapes8b, False, 1, False),
              ("qwen3-8b kv8 batch", 8, {**q06, "H": 32, "kv": (8, 64), "lpad": True}, 5, shapes8b, False, 1, False),
              ("qwen3-0.6b kv8", 2, {**q06, "kv": (8, 64)}, 33, shapes06, False, 28, False),
              ("llama-1b kv8", 1, {**llama1b, "kv": (8, 32)}, 33, shapes_l1b, False, 16, False)]
    for name, M, head, nsplit, shapes, bias, n, stamps in layers:
        yield (f"layers x{n} {name} M{M}{' stamps' if stamps else ''}",
               layer_case(M, head, nsplit, shapes, bias, n, stamps))
    for M in (1, 2, 3, 8):
        for bits in (4, 8):
            yield f"gemv plain M{M} b{bits}", gemv_case(bf, M, 1024, 4096, bits, 64, 0, False, True, False)
    yield "gemv res", gemv_case(f16, 1, 2048, 1024, 4, 32, 1, False, False, True)
    yield "gemv silu norm", gemv_case(bf, 2, 1024, 6144, 4, 128, 2, True, False, False)
    yield "gemv fp32", gemv_case(mx.float32, 1, 192, 320, 4, 64, 0, False, False, False)
    for D in (64, 128, 256):
        for M in ((1, 2) if D == 256 else (1, 4, 8)):
            head = dict(D=D, H=16, HKV=8, L=1, freqs=D == 64, qknorm=D != 64, trad=False, qeps=1e-6,
                        keps=1e-6, log2_base=19.93, scale=1.0)
            yield f"gemv head D{D} M{M}", gemv_case(bf, M, 1024, 32 * D, 4, 64, 3, True, D == 64, False, head)
    for D in (64, 128, 256):
        for G in (1, 2, 4, 8):
            yield f"attn D{D} G{G}", attn_case(bf, 1, 8 * G, 8, D)
    for D in QKV.HEAD_DIMS:
        for G in (1, 8):
            for bits in QKV.KV_BITS:
                yield f"qattn D{D} G{G} b{bits}", qattn_case(bf, 1, 8 * G, 8, D, bits, 64, False)
    yield "qattn causal L8 f16", qattn_case(f16, 8, 32, 8, 128, 8, 32, True)
    # qmm at Qwen3-4B's shapes (QKV, o_proj + residual, gate/up + SiLU, down + residual), 9-64 rows
    for M in (9, 16, 32, 64):
        for epi, (K, N) in ((0, (2560, 6144)), (1, (4096, 2560)), (2, (2560, 19456)), (1, (9728, 2560))):
            yield f"qmm e{epi} K{K} M{M}", qmm_case(bf, M, K, N, 4, epi)
    yield "qmm 8-bit bias f16", qmm_case(f16, 12, 1024, 1024, 8, 0, True)
    for M, head in ((4, {**q06, "H": 32, "lpad": True}), (16, {**q06, "H": 32, "lpad": True}),
                    (8, {**q06, "H": 32, "kv": (8, 64)})):   # Qwen3-4B's QKV with its head
        yield f"qmm head D128 M{M}{' kv8' if 'kv' in head else ''}", qmm_case(bf, M, 2560, 6144, 4, 3, head=head)
    for M, (K, N) in ((4, (4096, 2560)), (8, (9728, 2560)), (16, (12288, 4096))):   # + the next RMSNorm
        yield f"qmm e1 norm K{K} M{M}", qmm_case(bf, M, K, N, 4, 1, norm=True)
    yield "qattn fp32", qattn_case(mx.float32, 1, 16, 8, 128, 4, 128, False)


def main():
    filt = sys.argv[1] if len(sys.argv) > 1 else ""
    ptxas = _find(["nvidia/cuda_nvcc/bin/ptxas", "bin/ptxas"])
    bad = 0
    with tempfile.TemporaryDirectory() as td:
        for name, (src, threads, *limits) in cases():
            need, spill_ok = limits or (1, 0)   # blocks per SM, spilled bytes allowed (layer_case)
            if filt not in name:
                continue
            t0 = time.perf_counter()
            ptx, log = nvrtc_ptx(src, "k.cu")
            secs = time.perf_counter() - t0
            if ptx is None:
                bad += 1
                print(f"{name:22s} ERR\n" + "\n".join(l for l in log.splitlines() if "error" in l)[:2000])
                continue
            path = os.path.join(td, "k.ptx")
            open(path, "w").write(ptx)
            t0 = time.perf_counter()
            r = subprocess.run([ptxas, "-arch=sm_90a", "-v", "-o", os.path.join(td, "k.cubin"), path],
                               capture_output=True, text=True)
            secs_ptxas = time.perf_counter() - t0
            info = [l.split("ptxas info    : ")[-1] for l in r.stderr.splitlines() if "registers" in l or "spill" in l]
            regs = [int(x) for x in re.findall(r"Used (\d+) registers", r.stderr)]
            spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", r.stderr)]
            # an out-of-line call: NVRTC stopped inlining (a multi-layer launch's phases, see layer.py)
            calls = len(re.findall(r"^\s*call", ptx, re.M))
            # blocks of `threads` per SM that the registers allow (allocated 8 per thread at a time; the layer's
            # blockings assume 4: gemv.RESIDENT_BLOCKS)
            per_sm = min(65536 // (-(-max(regs) // 8) * 8 * threads), 2048 // threads) if regs else 0
            ok = (r.returncode == 0 and all(g * threads <= 65536 for g in regs) and max(spills, default=0) <= spill_ok
                  and not calls and per_sm >= need)
            print(f"{name:22s} {'OK ' if ok else 'ERR'} thr={threads} blocks/SM={per_sm} calls={calls} nvrtc={secs:.1f}s "
                  f"ptxas={secs_ptxas:.1f}s {' | '.join(info)[:160]}")
            if not ok:
                bad += 1
                print(r.stderr[-1500:])
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
