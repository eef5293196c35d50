"""metal_emu: run MLX `mx.fast.metal_kernel` kernels on the CPU, with checks a GPU does not make.

    import metal_emu
    k = metal_emu.metal_kernel(name=..., input_names=..., output_names=..., source=..., header=...)
    out = k(inputs=[...], output_shapes=[...], output_dtypes=[...], grid=..., threadgroup=...)

Same interface as mx.fast.metal_kernel. It takes the exact source MLX generates for the call, compiles
it as C++ against a Metal compatibility header (g++), and runs each threadgroup's lanes as fibers, so
barriers and SIMD-group functions behave as rendezvous. Problems raise KernelError (or a subclass)
whose message starts with `[metal_emu:<check>]`. Results are "emulator-verified", not Metal-verified:
see docs/metal-emulator.md.
"""

from .errors import (CallError, CompileError, Deadlock, DivergentBarrier, DivergentCollective,
                     EarlyReturnBeforeBarrier, KernelError, LintError, OrderDependence, OutOfBounds,
                     RuntimeFault, SignatureMismatch, StrictCompileError, ThreadgroupMemoryLimit,
                     ThreadgroupSize, Timeout, UninitializedThreadgroupRead, UnwrittenOutput)
from .kernel import EmuKernel, config, metal_kernel
from .source import capture_source, generate_source
from .strict import compile_strict, lint

LABEL = "emulator-verified"

__all__ = [
    "metal_kernel", "EmuKernel", "config", "compile_strict", "lint", "capture_source", "generate_source",
    "LABEL", "KernelError", "CallError", "CompileError", "Deadlock", "DivergentBarrier", "DivergentCollective",
    "EarlyReturnBeforeBarrier", "LintError", "OrderDependence", "OutOfBounds", "RuntimeFault",
    "SignatureMismatch", "StrictCompileError", "ThreadgroupMemoryLimit", "ThreadgroupSize", "Timeout",
    "UninitializedThreadgroupRead", "UnwrittenOutput",
]
