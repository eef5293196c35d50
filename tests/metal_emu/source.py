"""The exact Metal source MLX builds for an `mx.fast.metal_kernel` call.

Two ways, cross-checked against each other:
- `capture_source`: asks MLX itself. Calling the kernel with verbose=True inside `mx.export_function`
  tracing works without a Metal back-end (mlx >= 0.32) and prints the generated source to C++
  std::cout; we redirect file descriptor 1 to read it.
- `generate_source`: a Python re-implementation of MLX's rules (mlx/backend/common/metal_kernel.cpp,
  summarised in shared/notes/mlx-kernel-api.md §3): template line, inputs as `const device T*`
  (`const constant T*` below 8 elements, `const constant T&` for 0-d), `<name>_shape/_strides/_ndim`
  when the name occurs in the source, outputs (`device atomic<T>*` with atomic_outputs), the thread
  attributes whose names occur in the source, and the explicit instantiation with [[host_name]].
"""

import os
import sys
import tempfile

import mlx.core as mx

from .errors import SignatureMismatch

MAX_CONSTANT_ARRAY_SIZE = 8

# MLX's list, in MLX's order (alphabetical), with the parameter type
ATTRIBUTES = (
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
)

_TYPE_STRINGS = {
    mx.bool_: "bool",
    mx.uint8: "uint8_t",
    mx.uint16: "uint16_t",
    mx.uint32: "uint32_t",
    mx.uint64: "uint64_t",
    mx.int8: "int8_t",
    mx.int16: "int16_t",
    mx.int32: "int32_t",
    mx.int64: "int64_t",
    mx.float16: "float16_t",
    mx.bfloat16: "bfloat16_t",
    mx.float32: "float",
    mx.float64: "double",
    mx.complex64: "complex64_t",
}


def type_string(dtype):
    return _TYPE_STRINGS[dtype]


def _template_value(v):
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, mx.Dtype):
        return type_string(v)
    raise TypeError(f"template argument values must be Dtype, int or bool, got {type(v).__name__}")


def _template_kind(v):
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):
        return "int"
    return "typename"


def kernel_name(name, inputs, output_dtypes, template):
    k = "custom_kernel_" + name
    if template:
        k += "__" + "_".join(_template_value(v) for _, v in template)
    for a in inputs:
        k += "_" + type_string(a.dtype)
        if a.ndim == 0:
            k += "s"
        elif a.size < MAX_CONSTANT_ARRAY_SIZE:
            k += "c"
    for d in output_dtypes:
        k += "_" + type_string(d)
    return k


def generate_source(name, input_names, output_names, source, header, inputs, output_dtypes, template,
                    atomic_outputs):
    """(kernel_name, source) as MLX generates them."""
    kname = kernel_name(name, inputs, output_dtypes, template)
    out = header
    if template:
        out += "template <" + ", ".join(f"{_template_kind(v)} {n}" for n, v in template) + ">\n"
    out += f"[[kernel]] void {kname}(\n"
    params = []
    idx = 0
    for n, a in zip(input_names, inputs):
        loc = "constant" if a.size < MAX_CONSTANT_ARRAY_SIZE else "device"
        ref = "&" if a.ndim == 0 else "*"
        params.append(f"  const {loc} {type_string(a.dtype)}{ref} {n} [[buffer({idx})]]")
        idx += 1
        if a.ndim > 0:
            for suffix, decl in (("_shape", "const constant int*"), ("_strides", "const constant int64_t*"),
                                 ("_ndim", "const constant int&")):
                if n + suffix in source:
                    params.append(f"  {decl} {n}{suffix} [[buffer({idx})]]")
                    idx += 1
    for n, d in zip(output_names, output_dtypes):
        t = type_string(d)
        if atomic_outputs:
            t = f"atomic<{t}>"
        params.append(f"  device {t}* {n} [[buffer({idx})]]")
        idx += 1
    for attr, typ in ATTRIBUTES:
        if attr in source:
            params.append(f"  {typ} {attr} [[{attr}]]")
    out += ",\n".join(params) + ") {\n"
    out += source + "\n}\n"
    if template:
        tdef = kname + "<" + ", ".join(_template_value(v) for _, v in template) + ">"
        out += f'\ntemplate [[host_name("{kname}")]] [[kernel]] decltype({tdef}) {tdef};\n'
    return kname, out


class _FdCapture:
    """Captures what is written to file descriptor 1 (C++ std::cout) inside the block."""

    def __enter__(self):
        sys.stdout.flush()
        self._tmp = tempfile.TemporaryFile(mode="w+b")
        self._saved = os.dup(1)
        os.dup2(self._tmp.fileno(), 1)
        return self

    def __exit__(self, *exc):
        sys.stdout.flush()
        os.dup2(self._saved, 1)
        os.close(self._saved)
        self._tmp.seek(0)
        self.text = self._tmp.read().decode("utf-8", "replace")
        self._tmp.close()
        return False


def capture_source(spec, inputs, output_shapes, output_dtypes, grid, threadgroup, template, init_value):
    """The source MLX prints for this call, or None where MLX cannot trace it here."""
    kw = dict(name=spec["name"], input_names=spec["input_names"], output_names=spec["output_names"],
              source=spec["source"], header=spec["header"],
              ensure_row_contiguous=spec["ensure_row_contiguous"], atomic_outputs=spec["atomic_outputs"])
    if spec.get("compile_options") is not None:
        kw["compile_options"] = spec["compile_options"]
    k = mx.fast.metal_kernel(**kw)
    # example arguments with the same dtype and shape (only dtype, ndim and size < 8 matter)
    examples = [mx.zeros(a.shape, dtype=a.dtype) for a in inputs]

    def fn(*args):
        return k(inputs=list(args), output_shapes=output_shapes, output_dtypes=output_dtypes, grid=grid,
                 threadgroup=threadgroup, template=template, init_value=init_value, verbose=True)

    with tempfile.TemporaryDirectory() as d:
        try:
            with _FdCapture() as cap:
                mx.export_function(os.path.join(d, "k.mlxfn"), fn, *examples)
        except Exception:  # older MLX, or a Metal machine with different rules: fall back
            return None
    text = cap.text
    start = text.find("```\n")
    end = text.rfind("\n```")
    if start < 0 or end <= start:
        return None
    return text[start + 4:end]  # MLX prints the source, then std::endl


def mlx_source(spec, inputs, output_shapes, output_dtypes, grid, threadgroup, template, init_value):
    """(kernel_name, source, captured): MLX's capture, checked against the re-implementation."""
    kname, generated = generate_source(spec["name"], spec["input_names"], spec["output_names"], spec["source"],
                                       spec["header"], inputs, output_dtypes, template, spec["atomic_outputs"])
    captured = capture_source(spec, inputs, output_shapes, output_dtypes, grid, threadgroup, template, init_value)
    if captured is not None and captured != generated:
        import difflib

        diff = "\n".join(difflib.unified_diff(captured.splitlines(), generated.splitlines(), "mlx", "metal_emu",
                                              lineterm="", n=1))
        raise SignatureMismatch(
            "MLX's generated source differs from metal_emu's re-implementation of its rules "
            f"(MLX {mx.__version__}); update metal_emu/source.py:\n{diff}", kernel=spec["name"])
    return kname, (captured if captured is not None else generated), captured is not None
