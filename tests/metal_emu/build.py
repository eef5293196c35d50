"""MLX-generated Metal source -> C++ translation unit -> shared object (cached by content hash)."""

import ctypes
import hashlib
import os
import re
import subprocess
import tempfile
import threading
from pathlib import Path

from . import gen_swizzles
from .errors import CompileError, KernelError

HERE = Path(__file__).resolve().parent
CXX = os.environ.get("METAL_EMU_CXX", "g++")
EMU_FLAGS = ["-std=gnu++17", "-O1", "-fPIC", "-fno-gnu-unique", "-fno-strict-aliasing", "-fsingle-precision-constant",
             "-U_FORTIFY_SOURCE", "-w"]
_lock = threading.Lock()

# the parameter attribute -> C++ expression in the launch wrapper (I is the lane's LaneInfo)
ATTRIBUTE_VALUES = {
    "thread_position_in_grid": "mtl_rt::u3(I->tpig)",
    "thread_position_in_threadgroup": "mtl_rt::u3(I->tpitg)",
    "threadgroup_position_in_grid": "mtl_rt::u3(I->tgpig)",
    "threads_per_threadgroup": "mtl_rt::u3(I->tptg)",
    "dispatch_threads_per_threadgroup": "mtl_rt::u3(I->dtptg)",
    "threads_per_grid": "mtl_rt::u3(I->tpg)",
    "grid_size": "mtl_rt::u3(I->tpg)",
    "threadgroups_per_grid": "mtl_rt::u3(I->tgpg)",
    "grid_origin": "mtl_rt::u3(I->gorigin)",
    "thread_index_in_threadgroup": "I->tid",
    "thread_index_in_simdgroup": "I->lane",
    "simdgroup_index_in_threadgroup": "I->sgid",
    "simdgroups_per_threadgroup": "I->sg_per_tg",
    "dispatch_simdgroups_per_threadgroup": "I->dsg_per_tg",
    "thread_index_in_quadgroup": "I->qlane",
    "quadgroup_index_in_threadgroup": "I->qgid",
    "quadgroups_per_threadgroup": "I->qg_per_tg",
    "dispatch_quadgroups_per_threadgroup": "I->dqg_per_tg",
    "threads_per_simdgroup": "32u",
    "thread_execution_width": "32u",
}


def cache_dir():
    d = os.environ.get("METAL_EMU_CACHE")
    d = Path(d) if d else HERE.parent / ".metal_emu_cache"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _digest(*parts):
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode() if isinstance(p, str) else p)
        h.update(b"\0")
    return h.hexdigest()[:24]


def _support_digest():
    names = ["mtl_compat.h", "mlx_preamble.h", "runtime_api.h", "swizzles.inc", "runtime.cpp", "gen_swizzles.py"]
    return _digest(*[(HERE / n).read_bytes() for n in names], CXX)


# ---------------------------------------------------------------- source rewriting
_TG_DECL = re.compile(
    r"(?P<lead>(?:^|[;{}])\s*)threadgroup\s+(?P<type>[A-Za-z_][\w:]*(?:\s*<[^;{}()]*?>)?)\s+"
    r"(?P<name>[A-Za-z_]\w*)\s*(?P<dims>(?:\[[^\];]+\]\s*)*);",
    re.M,
)
_TG_LEFTOVER = re.compile(r"(?:^|[;{}])\s*threadgroup\s+[A-Za-z_][\w:<>, ]*\s+[A-Za-z_]\w*\s*(?:\[|=|,)", re.M)


def rewrite_threadgroup(src):
    """`threadgroup T name[N]...;` -> a reference to the threadgroup's shared, poisoned allocation."""
    counter = [0]

    def repl(m):
        counter[0] += 1
        t = f"{m['type']}{''.join(m['dims'].split())}"
        return f"{m['lead']}auto& {m['name']} = *mtl_rt::tg_alloc<{t}, {counter[0]}>();"

    out = _TG_DECL.sub(repl, src)
    left = _TG_LEFTOVER.search(out)
    if left:
        raise KernelError(
            f"cannot emulate this threadgroup declaration: {left.group(0).strip()!r}; declare one "
            "threadgroup array per statement, without an initializer (Metal allows none)",
            check="unsupported")
    return out


# ---------------------------------------------------------------- signature parsing
_SIG = re.compile(r"\[\[kernel\]\] void (?P<name>\w+)\(\n(?P<params>.*?)\) \{\n", re.S)
_PARAM = re.compile(r"^\s*(?P<decl>.*?)\s*\[\[(?P<attr>\w+)(?:\((?P<idx>\d+)\))?\]\]\s*$")
_INST = re.compile(r"decltype\((?P<name>\w+)(?P<targs><.*>)\)")


def parse_signature(src):
    """Kernel name, template arguments ("<...>" or ""), and parameters [(kind, type, name, index|attr)]."""
    m = _SIG.search(src)
    if not m:
        raise KernelError("no MLX kernel signature found in the source", check="signature")
    params = []
    for line in m["params"].split(",\n"):
        p = _PARAM.match(line)
        if not p:
            raise KernelError(f"cannot parse kernel parameter {line!r}", check="signature")
        decl = p["decl"]
        nm = re.search(r"(\w+)$", decl).group(1)
        typ = decl[: -len(nm)].strip()
        if p["attr"] == "buffer":
            params.append(("buffer", typ, nm, int(p["idx"])))
        else:
            params.append(("attr", typ, nm, p["attr"]))
    inst = _INST.search(src[m.end():])
    targs = inst["targs"] if inst and inst["name"] == m["name"] else ""
    return m["name"], targs, params


def launch_wrapper(kname, targs, params):
    args = []
    for kind, typ, nm, extra in params:
        if kind == "buffer":
            if typ.endswith("&"):
                args.append(f"*({typ[:-1].strip()}*)bufs[{extra}]")
            else:
                args.append(f"({typ})bufs[{extra}]")
        else:
            if extra not in ATTRIBUTE_VALUES:
                raise KernelError(f"unknown thread attribute [[{extra}]]", check="signature")
            args.append(ATTRIBUTE_VALUES[extra])
    joined = ",\n      ".join(args)
    return (
        '\nextern "C" void mtl_emu_lane_entry(void** bufs) {\n'
        "  mtl_rt::LaneInfo* I = mtl_rt::cur_info();\n"
        "  (void)I;\n"
        f"  {kname}{targs}(\n      {joined});\n"
        "}\n"
    )


_SWIZZLE_USE = re.compile(r"\.\s*([xyzw]{2,4}|[rgba]{2,4})\b")


def prelude(src):
    """The includes of a kernel translation unit, with only the vector swizzles `src` names."""
    used = set(_SWIZZLE_USE.findall(src))
    lines = []
    for n in (2, 3, 4):
        members = [m for m in gen_swizzles.members(n) if m.rstrip(";").split()[-1] in used]
        lines.append(f"#define MTL_SWIZZLES_{n} {' '.join(members)}")
    return "\n".join(lines) + '\n#include "mtl_compat.h"\n#include "mlx_preamble.h"\n'


def translation_unit(mlx_src, label):
    kname, targs, params = parse_signature(mlx_src)
    body = rewrite_threadgroup(mlx_src)
    tu = (
        prelude(mlx_src)
        + f'#line 1 "{label}"\n{body}\n'
        '#line 1 "metal_emu_launch_wrapper"\n' + launch_wrapper(kname, targs, params)
    )
    return tu, params


# ---------------------------------------------------------------- compiling
def _run(cmd, what, kernel):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        msg = r.stderr.strip()
        if len(msg) > 6000:
            msg = msg[:6000] + "\n..."
        raise CompileError(f"{what} failed:\n{msg}", kernel=kernel)


def _runtime_object():
    d = cache_dir()
    obj = d / f"runtime-{_support_digest()}.o"
    if not obj.exists():
        tmp = d / f".{obj.name}.{os.getpid()}.tmp"
        _run([CXX, "-std=c++14", "-O2", "-fPIC", "-U_FORTIFY_SOURCE", "-c", str(HERE / "runtime.cpp"), "-I",
              str(HERE), "-o", str(tmp)], "compiling the metal_emu runtime", None)
        os.replace(tmp, obj)
    return obj


_loaded = {}


_built = {}


def build(mlx_src, kernel):
    """Compiles (or finds in the cache) the emulation .so for this source; returns (ctypes lib, params)."""
    hit = _built.get((mlx_src, kernel))
    if hit is not None:
        return hit
    _built[(mlx_src, kernel)] = hit = _build(mlx_src, kernel)
    return hit


def _build(mlx_src, kernel):
    label = f"kernel:{kernel}"
    tu, params = translation_unit(mlx_src, label)
    key = _digest(tu, _support_digest(), " ".join(EMU_FLAGS), "-Wl,-Bsymbolic")
    with _lock:
        if key in _loaded:
            return _loaded[key], params
        d = cache_dir()
        so = d / f"k-{key}.so"
        if not so.exists():
            obj = _runtime_object()
            with tempfile.TemporaryDirectory(dir=d) as td:
                cpp = Path(td) / "kernel.cpp"
                cpp.write_text(tu)
                out = Path(td) / "k.so"
                _run([CXX, *EMU_FLAGS, "-shared", "-I", str(HERE), "-I", str(HERE / "include"), str(cpp),
                      str(obj), "-Wl,-Bsymbolic", "-o", str(out)], "compiling the kernel for the emulator", kernel)
                (d / f"k-{key}.cpp").write_text(tu)  # kept next to the .so for debugging
                os.replace(out, so)
        lib = ctypes.CDLL(str(so))
        lib.mtl_emu_launch.restype = ctypes.c_int
        _loaded[key] = lib
        return lib, params
