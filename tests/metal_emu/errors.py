"""Errors raised by metal_emu. Every message starts with `[metal_emu:<check>]`."""

import re


class KernelError(Exception):
    """A problem metal_emu found in a kernel (or its call). `check` names the check that found it."""

    check = "kernel"

    def __init__(self, message, check=None, kernel=None):
        if check is not None:
            self.check = check
        self.kernel = kernel
        where = f" kernel '{kernel}':" if kernel else ""
        super().__init__(f"[metal_emu:{self.check}]{where} {message}")


class CallError(KernelError):
    """The Python call does not match what MLX accepts (inputs, shapes, dtypes, grid)."""

    check = "call"


class SignatureMismatch(KernelError):
    check = "signature"


class CompileError(KernelError):
    check = "compile"


class StrictCompileError(KernelError):
    check = "strict-compile"


class LintError(KernelError):
    check = "lint"


class OutOfBounds(KernelError):
    check = "out-of-bounds"


class DivergentBarrier(KernelError):
    check = "divergent-barrier"


class EarlyReturnBeforeBarrier(DivergentBarrier):
    check = "early-return-before-barrier"


class DivergentCollective(KernelError):
    check = "divergent-collective"


class Deadlock(KernelError):
    check = "deadlock"


class ThreadgroupMemoryLimit(KernelError):
    check = "threadgroup-memory-limit"


class ThreadgroupSize(KernelError):
    check = "threadgroup-size"


class UninitializedThreadgroupRead(KernelError):
    check = "uninitialized-threadgroup-read"


class UnwrittenOutput(KernelError):
    check = "unwritten-output"


class OrderDependence(KernelError):
    check = "order-dependence"


class Timeout(Deadlock):
    """A dispatch that never finishes: typically a spin-wait on memory another threadgroup writes."""

    check = "timeout"


class RuntimeFault(KernelError):
    """Crash in the kernel not attributable to a guarded buffer (wild pointer, stack overflow, ...)."""

    check = "fault"


_BY_CHECK = {
    c.check: c
    for c in (
        CallError,
        SignatureMismatch,
        CompileError,
        StrictCompileError,
        LintError,
        OutOfBounds,
        DivergentBarrier,
        EarlyReturnBeforeBarrier,
        DivergentCollective,
        Deadlock,
        ThreadgroupMemoryLimit,
        ThreadgroupSize,
        UninitializedThreadgroupRead,
        UnwrittenOutput,
        OrderDependence,
        Timeout,
    )
}


def from_runtime(message, kernel, source=None):
    """Turns the runtime's "check: details" message into the matching KernelError subclass; call sites
    `kernel:<name>:<line>` are followed by the text of that line of the generated source."""
    check, _, details = message.partition(": ")
    if source is not None:
        lines = source.splitlines()
        tag = f"kernel:{kernel}:"

        def show(m):
            n = int(m.group(1))
            text = lines[n - 1].strip() if 0 < n <= len(lines) else ""
            return f"{m.group(0)} `{text}`" if text else m.group(0)

        details = re.sub(re.escape(tag) + r"(\d+)", show, details)
    cls = _BY_CHECK.get(check)
    if cls is None:
        return RuntimeFault(message, check=check or "fault", kernel=kernel)
    return cls(details, kernel=kernel)
