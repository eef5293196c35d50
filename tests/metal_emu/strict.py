"""The strict compile tier: MLX's generated source through g++ as C++14 with warnings as errors, plus a
lint for what C++ allows and Metal does not (double, the standard library, recursion, exceptions, ...).

It is closer to Apple's compiler than the emulation build, not a substitute: Apple-only errors remain
possible (see docs/metal-emulator.md).
"""

import re
import subprocess
import tempfile
import threading
from pathlib import Path

from . import build
from .errors import LintError, StrictCompileError, ThreadgroupMemoryLimit

STRICT_FLAGS = ["-std=c++14", "-fsyntax-only", "-Wall", "-Wextra", "-Werror", "-Wdouble-promotion",
                "-Wno-unused-parameter", "-Wno-attributes", "-Wno-unknown-pragmas"]
TG_LIMIT = 32 * 1024
_SIZES = {"float": 4, "half": 2, "bfloat": 2, "float16_t": 2, "bfloat16_t": 2, "int": 4, "uint": 4, "short": 2,
          "ushort": 2, "char": 1, "uchar": 1, "bool": 1, "long": 8, "ulong": 8, "int32_t": 4, "uint32_t": 4,
          "int16_t": 2, "uint16_t": 2, "int8_t": 1, "uint8_t": 1, "int64_t": 8, "uint64_t": 8}
for _t, _s in list(_SIZES.items()):
    if _t in ("float", "half", "bfloat", "int", "uint", "short", "ushort", "char", "uchar", "long", "ulong"):
        for _n in (2, 3, 4):
            _SIZES[f"{_t}{_n}"] = _s * (4 if _n == 3 else _n)
_SIZES["simdgroup_float8x8"] = 256
_SIZES["simdgroup_half8x8"] = 128

_ATTR_NAMES = ("dispatch_quadgroups_per_threadgroup|dispatch_simdgroups_per_threadgroup|"
               "dispatch_threads_per_threadgroup|grid_origin|grid_size|quadgroup_index_in_threadgroup|"
               "quadgroups_per_threadgroup|simdgroup_index_in_threadgroup|simdgroups_per_threadgroup|"
               "thread_execution_width|thread_index_in_quadgroup|thread_index_in_simdgroup|"
               "thread_index_in_threadgroup|thread_position_in_grid|thread_position_in_threadgroup|"
               "threadgroup_position_in_grid|threadgroups_per_grid|threads_per_grid|threads_per_simdgroup|"
               "threads_per_threadgroup")

LINT_RULES = [
    (r"\bdouble\b", "`double` is not supported by Metal"),
    (r"\bstd\s*::", "the C++ standard library (std::) is not available in Metal; use metal:: equivalents"),
    (r"\bnew\s+[A-Za-z_(]|\bdelete\b", "dynamic allocation (new/delete) is not available in Metal"),
    (r"\b(?:malloc|calloc|realloc|free)\s*\(", "dynamic allocation is not available in Metal"),
    (r"\bvirtual\b", "virtual functions are not supported by Metal"),
    (r"\b(?:try|catch|throw)\b", "exceptions are not supported by Metal"),
    (r"\b(?:dynamic_cast|typeid)\b", "RTTI is not supported by Metal"),
    (r"\bthread_local\b", "thread_local is not supported by Metal"),
    (r"\bgoto\b", "goto is not supported by Metal"),
    (r"#\s*include\s*[<\"](?!metal_)[^>\"]*[>\"]", "only Metal's own headers (<metal_*>) can be included"),
    (r"\b(?:printf|puts|fprintf)\s*\(", "C stdio is not available in Metal kernels"),
    (r"\b(?:uint3|uint|int|auto|ushort|uint32_t|const\s+uint3?)\s+(?:" + _ATTR_NAMES + r")\s*[=;]",
     "a local variable named like a thread attribute: MLX also injects it as a kernel parameter "
     "(duplicate definition)"),
]


def strip_comments_and_strings(src):
    def repl(m):
        s = m.group(0)
        return "" if s.startswith("/") else '""'
    return re.sub(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\])*"', repl, src, flags=re.S)


def _functions(src):
    """(name, body) of function definitions at brace depth 0."""
    out = []
    for m in re.finditer(r"\b([A-Za-z_]\w*)\s*\([^;{}()]*(?:\([^;{}()]*\)[^;{}()]*)*\)\s*(?:const\s*)?\{", src):
        name = m.group(1)
        if name in ("if", "for", "while", "switch", "return", "sizeof", "decltype"):
            continue
        depth = 0
        for i in range(m.end() - 1, len(src)):
            if src[i] == "{":
                depth += 1
            elif src[i] == "}":
                depth -= 1
                if depth == 0:
                    out.append((name, src[m.end():i]))
                    break
    return out


def lint(header, body, kernel=None):
    """Raises LintError for constructs Metal rejects (ThreadgroupMemoryLimit for static arrays over 32 KiB)."""
    problems = []
    for part, text in (("header", header), ("source", body)):
        code = strip_comments_and_strings(text)
        for pat, why in LINT_RULES:
            for m in re.finditer(pat, code):
                line = code[: m.start()].count("\n") + 1
                problems.append(f"{part} line {line}: {why}: {m.group(0).strip()!r}")
        for name, fbody in _functions(code):
            if re.search(r"\b" + re.escape(name) + r"\s*(?:<[^;{}]*?>)?\s*\(", fbody):
                problems.append(f"{part}: function '{name}' calls itself: recursion is not supported by Metal")
        total = 0
        for m in re.finditer(r"\bthreadgroup\s+([A-Za-z_]\w*)\s+[A-Za-z_]\w*\s*((?:\[\s*\d+\s*\]\s*)+);", code):
            size = _SIZES.get(m.group(1))
            if size is None:
                continue
            for d in re.findall(r"\d+", m.group(2)):
                size *= int(d)
            total += size
        if total > TG_LIMIT:
            raise ThreadgroupMemoryLimit(
                f"(static check of the {part}) threadgroup arrays of {total} bytes exceed the 32 KiB "
                "(32768 bytes) Apple GPUs allow per threadgroup", kernel=kernel)
    if problems:
        raise LintError("Metal does not allow:\n  " + "\n  ".join(problems), kernel=kernel)


_done = set()
_lock = threading.Lock()


class _Pending:
    """A strict compile running in the background (overlaps with the emulation build)."""

    def __init__(self, proc, tmpdir, marker, key, kernel):
        self.proc, self.tmpdir, self.marker, self.key, self.kernel = proc, tmpdir, marker, key, kernel

    def wait(self):
        _, err = self.proc.communicate()
        self.tmpdir.cleanup()
        if self.proc.returncode != 0:
            raise StrictCompileError(
                "the generated source does not compile as C++14 with warnings as errors (flags: "
                f"{' '.join(STRICT_FLAGS)}):\n{err.strip()[:6000]}", kernel=self.kernel)
        self.marker.write_text("ok\n")
        with _lock:
            _done.add(self.key)


def start_strict(mlx_src, header, body, kernel=None):
    """Lints now; starts the strict compile of one generated instantiation unless already passed (cached
    by content). Returns a _Pending to wait() on, or None."""
    key = build._digest(mlx_src, build._support_digest(), " ".join(STRICT_FLAGS))
    if key in _done:
        return None
    marker = build.cache_dir() / f"strict-{key}.ok"
    if marker.exists():
        with _lock:
            _done.add(key)
        return None
    lint(header, body, kernel)
    tu = build.prelude(mlx_src) + f'#line 1 "kernel:{kernel}"\n{mlx_src}\n'
    td = tempfile.TemporaryDirectory(dir=build.cache_dir())
    cpp = Path(td.name) / "strict.cpp"
    cpp.write_text(tu)
    proc = subprocess.Popen([build.CXX, *STRICT_FLAGS, "-I", str(build.HERE), "-I", str(build.HERE / "include"),
                             str(cpp)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return _Pending(proc, td, marker, key, kernel)


def check_strict(mlx_src, header, body, kernel=None):
    """Lint + strict compile of one generated instantiation (cached by content)."""
    pending = start_strict(mlx_src, header, body, kernel)
    if pending is not None:
        pending.wait()


def compile_strict(name, input_names, output_names, source, header="", ensure_row_contiguous=True,
                   atomic_outputs=False, compile_options=None, *, inputs, output_dtypes, output_shapes=None,
                   template=None, grid=(1, 1, 1), threadgroup=(1, 1, 1), init_value=None):
    """Strict-tier check of one instantiation, without running it. Same arguments as creating the kernel
    with mx.fast.metal_kernel(...) plus the call's inputs (arrays of the right dtype/shape), output dtypes
    and template. Returns the MLX-generated source that was checked; raises LintError or
    StrictCompileError (both metal_emu.KernelError)."""
    import mlx.core as mx

    from .source import mlx_source

    spec = dict(name=name, input_names=list(input_names), output_names=list(output_names), source=source,
                header=header, ensure_row_contiguous=ensure_row_contiguous, atomic_outputs=atomic_outputs,
                compile_options=compile_options)
    inputs = [x if isinstance(x, mx.array) else mx.array(x) for x in inputs]
    if output_shapes is None:
        output_shapes = [(1,)] * len(output_names)
    _, src, _ = mlx_source(spec, inputs, output_shapes, output_dtypes, grid, threadgroup, template, init_value)
    check_strict(src, header, source, kernel=name)
    return src
