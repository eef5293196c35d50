"""Offline syntax/resource check of the CUDA kernel bodies with nvcc (no GPU needed).

Wraps each body the way mx.fast.cuda_kernel does (mlx-kernel-api.md section 4.1) and compiles it
with `nvcc -arch=sm_90a -c -Xptxas -v`. Usage: python3 tests/cuda_compile_check.py [filter]
"""

import os
import subprocess
import sys
import tempfile

import mlx.core as mx

from mlx_fastops.backends import cuda as C

PRE = r"""
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cooperative_groups.h>
#include <cstdint>
struct Shape { int32_t d[10]; __device__ int32_t operator[](int i) const { return d[i]; } };
namespace mlx { namespace core { namespace cu {
namespace cg = cooperative_groups;
"""


def wrap(name, src, inputs, outputs):
    params = []
    for n, t in inputs:
        params.append(f"const {t}* {n}")
        if f"{n}_shape" in src and not (n == "kc" and "kc_shape[2]" not in src):
            params.append(f"const __grid_constant__ Shape {n}_shape")
    for n, t in outputs:
        params.append(f"{t}* {n}")
    return PRE + f"__global__ void {name}(" + ", ".join(params) + ") {\n" + src + "\n}\n}}}\n"


def gemv_case(dtype, M, K, N, bits, gs, epi, norm, bias, res, head=None):
    T = C._CTYPE[dtype]
    d = C.gemv_defines(dtype, M, K, N, bits, gs, epi, norm, bias, head)
    src = C.source("gemv.cu", d, dtype)
    types = {"x": T, "w": "uint32_t", "sc": T, "bi": T, "nw": T, "eps": "float", "bias": T,
             "res": T, "qn": T, "kn": T, "qkeps": "float", "off": "int32_t", "rb": "float",
             "rf": "float", "kc": T, "vc": T}
    ins = [(n, types[n]) for n in C.gemv_inputs(norm, bias, res, head)]
    outs = [("yq", T)] if epi == 3 else [("y", T)]
    _, _, _, NW = C.gemv_config(M, K, bits, epi, head and head["D"])
    return wrap(f"gemv_e{epi}_m{M}_b{bits}", src, ins, outs), NW * 32


def attn_case(dtype, L, H, HKV, D):
    T = C._CTYPE[dtype]
    d = dict(L=L, H=H, HKV=HKV, D=D, G=H // HKV, NW=C.attn_warps(D, H // HKV), SCALE_LOG2="0.1275f")
    src = C.source("attention.cu", d, dtype)
    ins = [("q", T), ("kc", T), ("vc", T), ("off", "int32_t"), ("cnt", "int32_t")]
    return wrap(f"attn_d{D}_g{H // HKV}", src, ins, [("o", T), ("part", "float")]), C.attn_warps(D, H // HKV) * 32


def cases():
    bf, f16 = mx.bfloat16, mx.float16
    for M in (1, 2, 3, 8):
        for bits in (4, 8):
            yield f"gemv plain M{M} b{bits}", gemv_case(bf, M, 1024, 4096, bits, 64, 0, False, True, False)
    yield "gemv res", gemv_case(f16, 1, 2048, 1024, 4, 32, 1, False, False, True)
    yield "gemv silu norm", gemv_case(bf, 2, 1024, 6144, 4, 128, 2, True, False, False)
    yield "gemv fp32", gemv_case(mx.float32, 1, 192, 320, 4, 64, 0, False, False, False)
    for D in (64, 128, 256):
        for M in ((1, 2) if D == 256 else (1, 4, 8)):
            head = dict(D=D, H=16, HKV=8, L=1, freqs=D == 64, qknorm=D != 64, trad=False)
            yield f"gemv head D{D} M{M}", gemv_case(bf, M, 1024, 32 * D, 4, 64, 3, True, D == 64, False, head)
    for D in (64, 128, 256):
        for G in (1, 2, 4, 8):
            yield f"attn D{D} G{G}", attn_case(bf, 1, 8 * G, 8, D)


def main():
    filt = sys.argv[1] if len(sys.argv) > 1 else ""
    bad = 0
    with tempfile.TemporaryDirectory() as td:
        for name, (src, threads) in cases():
            if filt not in name:
                continue
            path = os.path.join(td, "k.cu")
            open(path, "w").write(src)
            r = subprocess.run(["nvcc", "-arch=sm_90a", "-c", "-Xptxas", "-v", "-o", os.path.join(td, "k.o"), path],
                               capture_output=True, text=True)
            info = [l.split("ptxas info    : ")[-1] for l in r.stderr.splitlines() if "registers" in l or "spill" in l]
            errs = [l for l in r.stderr.splitlines() if "error" in l]
            import re
            regs = [int(x) for x in re.findall(r"Used (\d+) registers", r.stderr)]
            fits = all(g * threads <= 65536 for g in regs)
            print(f"{name:22s} {'OK ' if r.returncode == 0 and fits else 'ERR'} thr={threads} {' | '.join(info)[:160]}")
            if not fits:
                bad += 1
            if r.returncode:
                bad += 1
                print("\n".join(errs[:10]))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
