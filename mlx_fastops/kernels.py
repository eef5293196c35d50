"""Where kernel sources live and how kernel objects are built.

Sources are real files (metal/*.metal, cuda/*.cu) at the top of a source checkout and inside the
package (mlx_fastops/metal, ...) in an installed wheel. Kernel objects are built lazily through
`cached_builder` functions so each (op, dtype, shape class) compiles once per process.

All Metal wrappers construct kernels through `metal_kernel(...)`; tests swap the factory for the
CPU emulator (tests/metal_emu) with `use_metal_factory`, so the same wrappers run unchanged there.
"""

import contextlib
import functools
import re
from pathlib import Path

import mlx.core as mx

_PKG = Path(__file__).resolve().parent


def data_dir(kind):
    """Directory of `kind` ("metal", "cuda" or "patches"): package data first, then the checkout."""
    for base in (_PKG / kind, _PKG.parent / kind):
        if base.is_dir():
            return base
    raise FileNotFoundError(f"mlx_fastops: no {kind}/ directory in {_PKG} or {_PKG.parent}")


@functools.lru_cache(maxsize=None)
def read_source(kind, filename):
    return (data_dir(kind) / filename).read_text()


_SECTION = "// ==== "


@functools.lru_cache(maxsize=None)
def sections(kind, filename):
    """{section name: text} of a sectioned kernel source file (`kind`/`filename`).

    A line `// ==== name ====` starts section `name`, which runs to the next such line; text
    before the first one (the file's comment) belongs to no section. Each text ends in a newline.
    """
    out, name, lines = {}, None, []
    for line in read_source(kind, filename).splitlines():
        s = line.strip()
        if s.startswith(_SECTION) and s.endswith(" ===="):
            if name is not None:
                out[name] = "\n".join(lines) + "\n"
            name, lines = s[len(_SECTION):-len(" ====")].strip(), []
        elif name is not None:
            lines.append(line)
    if name is not None:
        out[name] = "\n".join(lines) + "\n"
    return out


def dtype_tag(dtype):
    """Short dtype name for kernel names (f16, bf16, f32)."""
    return {mx.float16: "f16", mx.bfloat16: "bf16", mx.float32: "f32"}.get(dtype, str(dtype))


_builders = []


def cached_builder(fn):
    """lru_cache that `use_*_factory` can clear (kernels built by the old factory are dropped)."""
    cached = functools.lru_cache(maxsize=None)(fn)
    _builders.append(cached)
    return cached


def clear_builders():
    for b in _builders:
        b.cache_clear()


_DEFAULT_FACTORIES = {"metal": mx.fast.metal_kernel, "cuda": getattr(mx.fast, "cuda_kernel", None)}
_factories = dict(_DEFAULT_FACTORIES)


def factory_replaced(kind):
    """True inside use_metal_factory / use_cuda_factory (e.g. a CPU emulator stands in for the GPU)."""
    return _factories[kind] is not _DEFAULT_FACTORIES[kind]


def metal_kernel(**kwargs):
    """mx.fast.metal_kernel, or the factory installed by `use_metal_factory`."""
    return _factories["metal"](**kwargs)


# A comment, or a string/char literal (kept: it may hold "//").
_COMMENT_OR_LITERAL = re.compile(r'//[^\n]*|/\*.*?\*/|("(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\')', re.S)


def compact_source(src):
    """C/CUDA source without comments, indentation or blank lines (line structure kept, so
    preprocessor directives and line continuations are untouched)."""
    src = _COMMENT_OR_LITERAL.sub(lambda m: m.group(1) or "", src)
    return "".join(line.strip() + "\n" for line in src.splitlines() if line.strip())


_DIRECTIVE = re.compile(r"\s*#\s*(if|ifdef|ifndef|elif|else|endif)\b(.*)")


def _condition(directive, expr, defines, undefined=()):
    """True/False for `#if NAME`, `#if NAME == <int>`, `#ifdef NAME`, `#ifndef NAME` over the
    integer-valued `defines` (and for `#ifdef` / `#ifndef`, the names known to be `undefined`);
    None for anything else (left to the compiler)."""
    expr = expr.split("//")[0].strip()
    if directive in ("ifdef", "ifndef"):
        if expr in defines:
            return directive == "ifdef"
        return (directive == "ifndef") if expr in undefined else None
    m = re.fullmatch(r"(\w+)(?:\s*==\s*(-?\d+))?", expr)
    if not m or m.group(1) not in defines:
        return None
    try:
        v = int(defines[m.group(1)])
    except (TypeError, ValueError):
        return None
    return v == int(m.group(2)) if m.group(2) is not None else v != 0


def resolve_conditionals(src, defines, undefined=()):
    """src with each conditional that `defines` and `undefined` decide (see _condition) cut down
    to the branch taken; the others stay. The compiler would drop the same text: this only shortens
    the source (MLX hashes a CUDA kernel's source at every launch: see cuda_kernel). `defines` must
    be the values the names have where the conditionals stand, `undefined` names that are not
    defined there (src must not #define or #undef them)."""
    out, stack, emitting = [], [], True   # stack frames: [mode, emitting outside, a branch taken]
    for line in src.splitlines(keepends=True):
        m = _DIRECTIVE.match(line)
        if not m:
            if emitting:
                out.append(line)
            continue
        d, expr = m.groups()
        if d in ("if", "ifdef", "ifndef"):
            v = _condition(d, expr, defines, undefined) if emitting else None
            mode = "skip" if not emitting else ("keep" if v is None else "cut")
            stack.append([mode, emitting, bool(v)])
            if mode == "keep":
                out.append(line)
            elif mode == "cut":
                emitting = bool(v)
            continue
        frame = stack[-1]
        mode, outer, taken = frame
        if mode == "keep":
            out.append(line)
        elif mode == "cut":
            if d == "elif":
                v = None if taken else _condition("if", expr, defines, undefined)
                if not taken and v is None:   # undecided after decided-false branches: an #if now
                    frame[0] = "keep"
                    out.append(line.replace("elif", "if", 1))
                    emitting = outer
                    continue
                emitting = bool(v) and not taken
                frame[2] = taken or bool(v)
            elif d == "else":
                emitting = outer and not taken
                frame[2] = True
            else:
                emitting = outer
        if d == "endif":
            stack.pop()
    if stack:
        raise ValueError("unterminated #if in kernel source")
    return "".join(out)


def cuda_kernel(**kwargs):
    """mx.fast.cuda_kernel, or the factory installed by `use_cuda_factory`, given compacted source
    and header: MLX hashes a CUDA kernel's whole source at every launch (its JIT module's name),
    so the source's length is host time per launch (the Qwen3-8B one-launch layer: 91 KB -> 38 KB)."""
    for k in ("source", "header"):
        if kwargs.get(k):
            kwargs[k] = compact_source(kwargs[k])
    return _factories["cuda"](**kwargs)


@contextlib.contextmanager
def _use_factory(kind, factory):
    old = _factories[kind]
    _factories[kind] = factory
    clear_builders()
    try:
        yield
    finally:
        _factories[kind] = old
        clear_builders()


def use_metal_factory(factory):
    """Build every Metal kernel with `factory` (same signature as mx.fast.metal_kernel) inside."""
    return _use_factory("metal", factory)


def use_cuda_factory(factory):
    """Build every CUDA kernel with `factory` (same signature as mx.fast.cuda_kernel) inside: the
    CPU emulator of tests/cuda_emu runs the CUDA backend's wrappers unchanged."""
    return _use_factory("cuda", factory)
